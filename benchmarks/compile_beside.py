"""A server's answers while its first compile runs beside the engine (``decode.compile=auto``).

Starts ``python -m pipeline mode=serve model.path=DIR`` (``serve_load.Server``) with a fresh,
empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR``), so the compiled step is built from nothing
while the server answers, and asks it, through the ``openai`` client, for one greedy answer of
``--tokens`` tokens after another for ``--seconds`` (``--pause`` seconds apart: a user reading).
The switch to the compiled step is read from ``/metrics`` (``mm_decode_compiled``) after each
answer.

Reports the first answer's seconds (what the first user of a fresh server waits), the median and
slowest answer before the switch, when the switch came, the median after, and how many answers
the whole time gave. Exit status 1 if any request failed (a server's 500 is an answer lost).

    python benchmarks/compile_beside.py --model DIR
    python benchmarks/compile_beside.py --model DIR --pause 5      # a chat's pace
    python benchmarks/compile_beside.py --model DIR --seconds 120 kv.memory=1GiB   # trailing: server overrides
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import Server  # noqa: E402


def compiled(url: str) -> bool:
    """Whether the server decodes on the compiled step now (its ``/metrics`` gauge)."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    return any(line.startswith("mm_decode_compiled ") and float(line.split()[1]) == 1.0 for line in text.splitlines())


def answers(url: str, tokens: int, seconds: float, pause: float) -> tuple[list[tuple[float, float, bool]], int]:
    """(start, seconds, compiled after it) of each answer asked one after another for
    ``seconds``, ``pause`` seconds apart, and how many requests failed."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    up, out, failed = time.perf_counter(), [], 0
    while time.perf_counter() - up < seconds:
        t0 = time.perf_counter()
        try:
            messages = [{"role": "user", "content": "Tell me a story."}]
            client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0)
        except Exception as err:  # the openai client's errors: counted, reported, the run goes on
            failed += 1
            print(f"request failed: {type(err).__name__}: {err}", file=sys.stderr)
            continue
        out.append((t0 - up, time.perf_counter() - t0, compiled(url)))
        time.sleep(pause)
    return out, failed


def summary(times: list[tuple[float, float, bool]], failed: int) -> dict:
    """The figures of ``answers``' record."""
    switch = next((start + took for start, took, done in times if done), None)
    before = [took for start, took, done in times if not done]
    after = [took for start, took, done in times if done]
    return {
        "first_s": times[0][1] if times else None,
        "before_median_s": statistics.median(before) if before else None,
        "before_max_s": max(before) if before else None,
        "switch_s": switch,
        "after_median_s": statistics.median(after) if after else None,
        "answers": len(times),
        "failed": failed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder (model.path)")
    parser.add_argument("--seconds", type=float, default=200.0, help="how long to ask (default 200)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens an answer (default 64)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between answers (a user reading; default 0)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("overrides", nargs="*", help="server overrides (key=value)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compile-beside-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # the server's: a first compile
        server = Server([f"model.path={args.model}", *args.overrides], 600.0, Path(tmp))
        try:
            server.wait_ready()
            figures = summary(*answers(server.url, args.tokens, args.seconds, args.pause))
        except RuntimeError as err:
            print(f"error: {err}\n{server.log_tail()}", file=sys.stderr)
            return 2
        finally:
            server.stop()
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
