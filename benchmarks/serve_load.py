"""Load generator for ``mode=serve``: N concurrent streaming clients over HTTP, a fixed number
of requests per phase, stops by itself.

Either starts the server itself (``python -m pipeline mode=serve serve.port=PORT [overrides]``
on a free loopback port, waits for ``GET /health`` == 200, always terminates it at the end, and
it ends if this script is killed) or
uses a running one (``--url http://host:port``, ``--api-key``). Every request goes through the
official ``openai`` client: ``chat.completions.create(stream=True,
stream_options={"include_usage": True}, max_tokens=M, temperature=0)``, the model id taken from
``GET /v1/models``, the same requests in every phase (fixed seed).

The workload (``--prompts``): ``shapes`` (the default) asks the questions the embedded default
model was trained on ("What shapes are in the image?", "How many shapes are there?") about
varied images drawn by ``pipeline.tiny.shapes``, each sent as OpenAI image content (an
``image_url`` part holding a base64 PNG data: URI) before the question, so the embedded default
answers every request ("a blue triangle and a red circle"); the answers are also checked
against the drawn shapes ("correct"). ``text`` sends short varied text prompts instead (for a
real model: the embedded default ends those at once, with no content), optionally each with a
generated image (``--image SIZE``).

Phases (``--concurrency 1,32``), one after another against the same server, in one process:
each sends ``--requests`` requests with at most C in flight (C workers, each sends its next
request when its previous one ends). With ``--reps R`` the phases alternate (forward, then
reversed order, ...) and each figure is the median over the repetitions; the ratio is taken
against concurrency 1 measured in the same repetition.

Per request, client side: TTFT = request sent -> first content delta; TPOT = (end - first
token) / (completion tokens - 1); completion tokens from the final usage chunk. Per phase:
wall s, aggregate completion tok/s (all completion tokens / wall), ratio to concurrency 1,
p50/p99 TTFT and TPOT, errors (exceptions, timeouts, a stream without usage or without text),
how many answers are correct (``shapes``), how many equal the concurrency-1 answer to the same
prompt (greedy: batching should not change the text; in float32 only a near-tie of the top two
logits may: ``--json`` lists the differing answers), and the CPU seconds this client and (when
started here) the server used in the phase: on a small machine the client's own share bounds
what the server can get.

    python benchmarks/serve_load.py                                  # starts the server itself
    python benchmarks/serve_load.py --requests 64 --concurrency 1,8,32     # shorter: ramp-up and -down weigh more
    python benchmarks/serve_load.py --prompts text --image 64 engine.max_seqs=32   # trailing: server overrides
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --api-key KEY --json load.json

Exit status: 0, or 1 if any request failed, 2 if the server could not be started or reached.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout: the pipeline beside it, installed or not
from pipeline.model.lifetime import set_parent_death_signal  # noqa: E402  (no torch)

SUBJECTS = [
    "the sky",
    "a river",
    "an old clock",
    "the city at night",
    "a small garden",
    "the sea",
    "a mountain road",
    "a cup of tea",
    "the moon",
    "a library",
    "a red bicycle",
    "the wind",
    "a train station",
    "a winter morning",
    "a market",
    "a lighthouse",
]
ASKS = [
    "Describe {} in one sentence.",
    "Write a short poem about {}.",
    "What colour is {}?",
    "Tell me a fact about {}.",
    "Why do people like {}?",
    "Give three words for {}.",
    "Summarise {} for a child.",
    "What sound does {} make?",
]


# --------------------------------------------------------------------------- workload


def make_shapes(n: int, seed: int) -> list[tuple[str, str, str]]:
    """n requests of the embedded default's own task: (question, image as a PNG data URI, the
    expected answer), images and questions drawn from ``seed``."""
    import numpy as np

    from pipeline.tiny import shapes  # here, not at the top: it loads torch, which --help and --prompts text skip

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        image, drawn = shapes.draw(rng)
        question = shapes.QUESTIONS[int(rng.random() < 0.25)]  # mostly "which shapes", a quarter "how many"
        out.append((question, png_data_uri(image), shapes.answer(question, drawn)))
    return out


def png_data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(ASKS).format(rng.choice(SUBJECTS))} (#{i})" for i in range(n)]


def make_images(n: int, size: int, seed: int) -> list[str]:
    """n small PNGs (a colour gradient with a random tint each) as data URIs."""
    from PIL import Image

    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        r, g, b = (rng.randrange(256) for _ in range(3))
        img = Image.new("RGB", (size, size))
        img.putdata(
            [((r + x * 4) % 256, (g + y * 4) % 256, (b + x + y) % 256) for y in range(size) for x in range(size)]
        )
        out.append(png_data_uri(img))
    return out


def workload(args: argparse.Namespace) -> tuple[list[list[dict]], list[str | None]]:
    """The requests' messages and, where known, each one's expected answer."""
    if args.prompts == "shapes":
        drawn = make_shapes(args.requests, args.seed)
        return [messages(q, im) for q, im, _ in drawn], [expected for _, _, expected in drawn]
    prompts = make_prompts(args.requests, args.seed)
    images = make_images(args.requests, args.image, args.seed) if args.image else [None] * args.requests
    return [messages(p, im) for p, im in zip(prompts, images)], [None] * args.requests


def messages(prompt: str, image: str | None) -> list[dict]:
    if image is None:
        return [{"role": "user", "content": prompt}]
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": prompt}],
        }
    ]


# --------------------------------------------------------------------------- server


class Server:
    """``python -m pipeline mode=serve`` in a subprocess on a free loopback port."""

    def __init__(self, overrides: list[str], startup_timeout: float, log_dir: Path):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "server.log"
        args = ["mode=serve", f"serve.port={self.port}"]
        if not any(o.startswith("hydra.run.dir=") for o in overrides):
            args.append(f"hydra.run.dir={log_dir / 'run'}")  # keep outputs/ out of the repo
        self.cmd = [sys.executable, "-m", "pipeline", *args, *overrides]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # In a session of its own no Ctrl-C or group kill reaches it: it ends when this script
            # dies, however it dies (SIGTERM: the server drains and exits).
            preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM),
        )
        self.startup_timeout = startup_timeout

    def wait_ready(self) -> float:
        """Seconds until /health answered 200; raises RuntimeError if the server died or took too long."""
        t0 = time.perf_counter()
        deadline = t0 + self.startup_timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready (GET /health != 200) after {self.startup_timeout:.0f} s")

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the server process so far (Linux /proc), None elsewhere."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 45 s (to the process group this script created). Returns the status."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 45.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        return self.proc.poll()


# --------------------------------------------------------------------------- client


@dataclass
class Record:
    index: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    server_metrics: dict | None = field(default=None, repr=False)


async def one_request(
    client: openai.AsyncOpenAI, model: str, index: int, msgs: list[dict], max_tokens: int, timeout: float
) -> Record:
    rec = Record(index)
    parts: list[str] = []
    usage = None

    async def consume() -> None:
        nonlocal usage
        t0 = time.perf_counter()
        first = None
        stream = await client.chat.completions.create(
            model=model,
            messages=msgs,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=max_tokens,
            temperature=0,
        )
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
                extra = getattr(chunk, "model_extra", None) or {}
                if isinstance(extra.get("metrics"), dict):
                    rec.server_metrics = extra["metrics"]
        end = time.perf_counter()
        rec.latency_s = end - t0
        if first is not None:
            rec.ttft_s = first - t0
        if usage is not None:
            rec.completion_tokens = usage.completion_tokens
            rec.prompt_tokens = usage.prompt_tokens
            if first is not None and usage.completion_tokens and usage.completion_tokens > 1:
                rec.tpot_s = (end - first) / (usage.completion_tokens - 1)

    try:
        await asyncio.wait_for(consume(), timeout)
    except asyncio.TimeoutError:
        rec.error = f"timeout after {timeout:.0f} s ({len(parts)} deltas received)"
    except Exception as err:  # noqa: BLE001 - every failure is a counted error, the run goes on
        rec.error = f"{type(err).__name__}: {str(err)[:200]}"
    rec.text = "".join(parts)
    if rec.error is None:
        if usage is None:
            rec.error = "stream ended without a usage chunk"
        elif not rec.text:
            rec.error = "no content delta"
        elif not usage.completion_tokens or usage.completion_tokens > max_tokens:
            rec.error = f"usage.completion_tokens={usage.completion_tokens} (max_tokens={max_tokens})"
    rec.ok = rec.error is None
    return rec


async def run_phase(
    client: openai.AsyncOpenAI,
    model: str,
    all_msgs: list[list[dict]],
    concurrency: int,
    max_tokens: int,
    timeout: float,
) -> tuple[float, float, list[Record]]:
    """All requests, at most ``concurrency`` in flight: wall seconds, this client's CPU seconds, records
    in request order."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(all_msgs)):
        queue.put_nowait(i)
    records: list[Record | None] = [None] * len(all_msgs)

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records[i] = await one_request(client, model, i, all_msgs[i], max_tokens, timeout)

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(all_msgs)))))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return wall, cpu, [r for r in records if r is not None]


# --------------------------------------------------------------------------- figures


def pct(values: list[float], q: float) -> float | None:
    """Percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarise(wall: float, cpu: float, records: list[Record], expected: list[str | None] | None = None) -> dict:
    ok = [r for r in records if r.ok]
    expected = expected or [None] * len(records)
    checked = [(r, expected[r.index]) for r in records if expected[r.index] is not None]
    tokens = sum(r.completion_tokens or 0 for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {
        "wall_s": wall,
        "client_cpu_s": cpu,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "completion_tokens": tokens,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "checked": len(checked),
        "correct": sum(1 for r, want in checked if r.ok and r.text.strip() == want),
        "error_messages": sorted({r.error for r in records if r.error})[:10],
        "records": [
            {
                "i": r.index,
                "ttft_s": r.ttft_s,
                "tpot_s": r.tpot_s,
                "latency_s": r.latency_s,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "finish_reason": r.finish_reason,
                "error": r.error,
                "server": {k: r.server_metrics.get(k) for k in ("ttft_s", "tpot_s", "queue_s")}
                if r.server_metrics
                else None,
            }
            for r in records
        ],
    }


def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


# --------------------------------------------------------------------------- main


async def bench(args: argparse.Namespace, url: str, server: Server | None) -> dict:
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(args.timeout, connect=10.0),
        limits=httpx.Limits(
            max_connections=max(args.concurrency) + 8, max_keepalive_connections=max(args.concurrency) + 8
        ),
    )
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, http_client=http)
    try:
        models = [m.id async for m in client.models.list()]
        if not models:
            raise RuntimeError("GET /v1/models lists no model")
        model = models[0]
        all_msgs, expected = workload(args)

        for i in range(args.warmup):  # lazy first-request costs stay out of the figures
            rec = await one_request(client, model, i, all_msgs[i % len(all_msgs)], args.max_tokens, args.timeout)
            if not rec.ok:
                print(f"warm-up request {i} failed: {rec.error}", file=sys.stderr)

        reps: list[dict[int, dict]] = []
        texts: dict[int, list[list[str | None]]] = {c: [] for c in args.concurrency}
        for rep in range(args.reps):
            order = args.concurrency if rep % 2 == 0 else list(reversed(args.concurrency))
            figures = {}
            for c in order:
                server_cpu0 = server.cpu_seconds() if server else None
                wall, cpu, records = await run_phase(client, model, all_msgs, c, args.max_tokens, args.timeout)
                figures[c] = summarise(wall, cpu, records, expected)
                server_cpu1 = server.cpu_seconds() if server else None
                figures[c]["server_cpu_s"] = (
                    server_cpu1 - server_cpu0 if server_cpu0 is not None and server_cpu1 is not None else None
                )
                texts[c].append([r.text if r.ok else None for r in records])
                s = figures[c]
                print(
                    f"  rep {rep + 1}/{args.reps} concurrency {c:>3}: {s['wall_s']:.2f} s, "
                    f"{s['tok_s']:.1f} tok/s, {s['errors']} errors, "
                    + (f"{s['correct']}/{s['checked']} correct, " if s["checked"] else "")
                    + f"CPU s: client {s['client_cpu_s']:.2f}, "
                    f"server {fmt(s['server_cpu_s'], digits=2)}",
                    file=sys.stderr,
                    flush=True,
                )
                for msg in s["error_messages"][:3]:
                    print(f"      error: {msg}", file=sys.stderr)
            reps.append(figures)
    finally:
        await client.close()
        await http.aclose()

    base_c = args.concurrency[0] if 1 not in args.concurrency else 1
    phases = []
    for c in args.concurrency:
        per = [r[c] for r in reps]
        ratios = [r[c]["tok_s"] / r[base_c]["tok_s"] if r[base_c]["tok_s"] > 0 else None for r in reps]
        # answers equal to the baseline's answer to the same prompt, same repetition
        same = sum(
            sum(1 for a, b in zip(texts[c][k], texts[base_c][k]) if a is not None and a == b) for k in range(args.reps)
        )
        differs = [
            {
                "rep": k,
                "i": i,
                "common_prefix_chars": len(os.path.commonprefix([a, b])),
                "text": a[:200],
                "baseline_text": b[:200],
            }
            for k in range(args.reps)
            for i, (a, b) in enumerate(zip(texts[c][k], texts[base_c][k]))
            if a is not None and b is not None and a != b
        ]
        phases.append(
            {
                "concurrency": c,
                "wall_s": median([p["wall_s"] for p in per]),
                "client_cpu_s": median([p["client_cpu_s"] for p in per]),
                "server_cpu_s": median([p["server_cpu_s"] for p in per]),
                "tok_s": median([p["tok_s"] for p in per]),
                "ratio": median(ratios),
                "ttft_p50_s": median([p["ttft_p50_s"] for p in per]),
                "ttft_p99_s": median([p["ttft_p99_s"] for p in per]),
                "tpot_p50_s": median([p["tpot_p50_s"] for p in per]),
                "tpot_p99_s": median([p["tpot_p99_s"] for p in per]),
                "errors": sum(p["errors"] for p in per),
                "requests": sum(p["requests"] for p in per),
                "checked": sum(p["checked"] for p in per),
                "correct": sum(p["correct"] for p in per),
                "same_text_as_baseline": same,
                "differs": differs[:20],
                "reps": per,
            }
        )
    return {"model": model, "baseline_concurrency": base_c, "phases": phases}


def table(result: dict) -> str:
    base = result["baseline_concurrency"]
    lines = [
        f"| clients | wall s | tok/s | vs {base} client{'s' if base != 1 else ''} | TTFT p50 ms | TTFT p99 ms "
        f"| TPOT p50 ms | TPOT p99 ms | errors | text = {base} client{'s' if base != 1 else ''} "
        "| CPU s client / server |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["phases"]:
        lines.append(
            f"| {p['concurrency']} | {fmt(p['wall_s'], digits=2)} | {fmt(p['tok_s'])} "
            f"| **{fmt(p['ratio'], digits=2)}** | {fmt(p['ttft_p50_s'], 1e3)} | {fmt(p['ttft_p99_s'], 1e3)} "
            f"| {fmt(p['tpot_p50_s'], 1e3, 2)} | {fmt(p['tpot_p99_s'], 1e3, 2)} "
            f"| {p['errors']}/{p['requests']} | {p['same_text_as_baseline']}/{p['requests']} "
            f"| {fmt(p['client_cpu_s'], digits=2)} / {fmt(p['server_cpu_s'], digits=2)} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("overrides", nargs="*", help="extra overrides for the server it starts (e.g. engine.max_seqs=32)")
    ap.add_argument("--url", help="use a running server (http://host:port) instead of starting one")
    ap.add_argument(
        "--api-key", default=None, help="bearer key (default: $MM_PIPELINE_API_KEY, then $OPENAI_API_KEY, else none)"
    )
    ap.add_argument("--concurrency", default="1,32", help="comma-separated clients in flight per phase (default 1,32)")
    ap.add_argument(
        "--requests", type=int, default=256, help="requests per phase (default 256: mostly steady state at 32 clients)"
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--prompts",
        choices=("shapes", "text"),
        default="shapes",
        help="shapes (default): the embedded default's questions about drawn shapes images, sent as "
        "image content; text: short varied text prompts (the embedded default ends those at once)",
    )
    ap.add_argument(
        "--image",
        type=int,
        nargs="?",
        const=64,
        default=0,
        metavar="SIZE",
        help="with --prompts text: attach a generated SIZE x SIZE PNG (default 64; a different tint "
        "per request) as a data URI to every request",
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="repetitions, phases in alternating order; figures are medians (default 3)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the phases (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request limit in seconds (default 120)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument(
        "--target",
        type=float,
        default=5.0,
        help="checked: the largest concurrency's ratio to concurrency 1 (default 5.0)",
    )
    ap.add_argument("--json", metavar="FILE", help="write the figures here")
    args = ap.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        ap.error("--concurrency takes integers, e.g. 1,8,32")
    if not args.concurrency or min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1:
        ap.error("--concurrency, --requests and --max-tokens must be >= 1")
    args.api_key = args.api_key or os.environ.get("MM_PIPELINE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
    if args.image and args.prompts != "text":
        ap.error(
            "--image attaches a generated picture to text prompts: use it with --prompts text "
            "(the shapes workload sends its own images)"
        )
    if args.url and args.overrides:
        ap.error("server overrides only apply to a server this script starts (not with --url)")
    return args


def image_note(args: argparse.Namespace) -> str:
    if args.prompts == "shapes":
        return "shapes PNG"
    return f"{args.image}x{args.image} PNG" if args.image else "none"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):  # noqa: ARG001 - SIGTERM ends like Ctrl-C: the server is still stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    server = None
    status = 0
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        try:
            if args.url:
                url = args.url
                startup = None
            else:
                server = Server(args.overrides, args.startup_timeout, Path(tmp))
                url = server.url
                print(f"server: {' '.join(server.cmd[1:])}", file=sys.stderr, flush=True)
                try:
                    startup = server.wait_ready()
                except RuntimeError as err:
                    print(f"error: {err}", file=sys.stderr)
                    return 2
                print(f"server ready in {startup:.1f} s at {url}", file=sys.stderr, flush=True)
            try:
                result = asyncio.run(bench(args, url, server))
            except (openai.APIError, httpx.HTTPError, RuntimeError) as err:
                print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
                if server is not None:
                    print(f"--- server log (tail) ---\n{server.log_tail()}", file=sys.stderr)
                return 2
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        finally:
            if server is not None:
                code = server.stop()
                if code not in (0, -signal.SIGTERM):
                    print(
                        f"note: server exit status {code}\n--- server log (tail) ---\n{server.log_tail(15)}",
                        file=sys.stderr,
                    )

    head = (
        f"serve_load: {args.requests} requests per phase, max_tokens={args.max_tokens}, temperature 0, "
        f"prompts={args.prompts}, image={image_note(args)}, reps={args.reps}, "
        f"warm-up {args.warmup}; model {result['model']!r}; "
        f"{'server ready in %.1f s' % startup if startup is not None else 'server ' + args.url}; "
        f"openai {openai.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    print(head)
    print()
    print(table(result))
    if any(p["checked"] for p in result["phases"]):
        print(
            "\nanswers correct (the drawn shapes): "
            + ", ".join(
                f"{p['correct']}/{p['checked']} at {p['concurrency']} client{'s' if p['concurrency'] != 1 else ''}"
                for p in result["phases"]
            )
        )
    check = None
    top = max(args.concurrency)
    base = result["baseline_concurrency"]
    if base == 1 and top > 1:
        ratio = next(p["ratio"] for p in result["phases"] if p["concurrency"] == top)
        check = {
            "concurrency": top,
            "ratio": ratio,
            "target": args.target,
            "met": ratio is not None and ratio >= args.target,
        }
        print(
            f"\ntarget: {top} clients >= {args.target:g}x one at a time: "
            f"{'met' if check['met'] else 'NOT met'} ({fmt(ratio, digits=2)}x)"
        )
    errors = sum(p["errors"] for p in result["phases"])
    if errors:
        status = 1
        print(f"\n{errors} requests failed", file=sys.stderr)
    if args.json:
        out = {
            "args": {k: v for k, v in vars(args).items() if k != "api_key"},
            "server_cmd": server.cmd[1:] if server else None,
            "startup_s": startup,
            "openai": openai.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "target": check,
            **result,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
