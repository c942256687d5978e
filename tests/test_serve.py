"""mode=serve through the official ``openai`` client and raw HTTP: answers equal to ``mode=run``
and to solo runs under 32 concurrent clients, OpenAI-shaped errors that harm nobody in flight,
API keys, cancellation on disconnect, the prefix cache across turns, metrics, clean shutdown."""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf
from openai import APIStatusError, AuthenticationError, OpenAI
from PIL import Image

from conftest import run_cli
from serving import free_port, serving

KEY = "test-key-123"


def png_uri(seed: int = 0, size: int = 56) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB").save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def wav_b64(seconds: float = 1.0, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return base64.b64encode(buf.getvalue()).decode()


def mp4_bytes(frames: int = 8, fps: int = 4) -> bytes:
    """A small clip (a box moving over noise) written with PyAV, as an upload would carry it."""
    import av

    rng = np.random.default_rng(3)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            pixels = rng.integers(0, 60, (48, 64, 3), dtype=np.uint8)
            pixels[8:22, 4 * i : 4 * i + 14] = (240, 20, 20)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def image_message(text: str, uri: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}],
    }


@pytest.fixture(scope="module")
def vl(tiny_dir, tmp_path_factory):
    """The tiny Qwen2-VL in float64 (batched and solo answers are then identical, not near-ties)."""
    tmp = tmp_path_factory.mktemp("serve-vl")
    media = tmp / "media"
    media.mkdir()
    Image.new("RGB", (40, 40), (200, 30, 30)).save(media / "red.png")
    with serving(
        tmp,
        f"model.path={tiny_dir('qwen2-vl')}",
        "model.dtype=float64",
        "max_new_tokens=12",
        f"serve.allowed_media_dir={media}",
        "serve.max_tokens=100000",
        "serve.max_body_bytes=2000000",
        "kv.memory=64000000",
        "engine.max_seqs=32",
    ) as server:
        server.media = media
        yield server


@pytest.fixture(scope="module")
def client(vl) -> OpenAI:
    return OpenAI(base_url=vl.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def model_id(client: OpenAI) -> str:
    return client.models.list().data[0].id


def chat(client: OpenAI, messages: list, **kw):
    return client.chat.completions.create(model=model_id(client), messages=messages, **{"temperature": 0, **kw})


def streamed(client: OpenAI, messages: list, **kw) -> tuple[str, list]:
    chunks = list(chat(client, messages, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# --- answers -----------------------------------------------------------------------------------


def test_image_chat_equals_mode_run_streamed_or_not(vl, client, tiny_dir, tmp_path):
    img = tmp_path / "pic.png"
    Image.open(io.BytesIO(base64.b64decode(png_uri(1).split(",", 1)[1]))).save(img)
    cli = run_cli(
        f"model.path={tiny_dir('qwen2-vl')}",
        "model.dtype=float64",
        f"input={img}",
        "prompt=What is in the picture?",
        "max_new_tokens=12",
        "ignore_eos=true",
        "stream=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    expected = json.loads((tmp_path / "run" / "result.json").read_text())
    message = image_message("What is in the picture?", png_uri(1))
    whole = chat(client, [message], max_tokens=12, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == expected["text"]
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == expected["prompt_tokens"]
    assert whole.choices[0].finish_reason == "length"
    text, chunks = streamed(client, [message], max_tokens=12, extra_body={"ignore_eos": True})
    assert text == expected["text"]
    last = chunks[-1]
    assert last.usage.completion_tokens == 12 and last.choices == []
    extra = last.model_extra["metrics"]
    assert extra["ttft_s"] > 0 and extra["kv_reused_tokens"] > 0  # the same image again: from the prefix cache


def test_audio_chat_equals_the_pipeline(tiny_dir, load_tiny, tmp_path):
    from pipeline import Pipeline, Request
    from stages import AudioEncoder, DecodeLoop, Prefill, Tokenize

    wav = tmp_path / "tone.wav"
    wav.write_bytes(base64.b64decode(wav_b64()))
    lm = load_tiny("qwen2-audio")
    pipe = Pipeline(
        lm, {"tokenize": Tokenize(), "audio_encoder": AudioEncoder(), "prefill": Prefill(), "decode": DecodeLoop()}
    )
    alone = pipe.run(Request(prompt="What do you hear?", audios=[str(wav)], max_new_tokens=10, ignore_eos=True))
    with serving(tmp_path, f"model.path={tiny_dir('qwen2-audio')}", "model.dtype=float32") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        content = [
            {"type": "input_audio", "input_audio": {"data": wav_b64(), "format": "wav"}},
            {"type": "text", "text": "What do you hear?"},
        ]
        got = chat(client, [{"role": "user", "content": content}], max_tokens=10, extra_body={"ignore_eos": True})
        text, _ = streamed(
            client, [{"role": "user", "content": content}], max_tokens=10, extra_body={"ignore_eos": True}
        )
    assert got.choices[0].message.content == text == alone.text
    assert got.usage.prompt_tokens == alone.prompt_tokens


def test_video_url_equals_the_pipeline(vl, client, load_tiny):
    from pipeline import Pipeline, Request
    from pipeline.media import load_video
    from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

    raw = mp4_bytes()
    clip = vl.media / "clip.mp4"
    clip.write_bytes(raw)
    pipe = Pipeline(
        load_tiny("qwen2-vl", dtype="float64"),
        {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()},
    )
    alone = pipe.run(Request(prompt="What happens?", videos=[load_video(clip)], max_new_tokens=8, ignore_eos=True))

    def ask(url: str):
        part = {"type": "video_url", "video_url": {"url": url}}
        return chat(
            client,
            [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}],
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )

    for url in ("data:video/mp4;base64," + base64.b64encode(raw).decode(), f"file://{clip}"):
        got = ask(url)
        assert got.choices[0].message.content == alone.text and got.usage.prompt_tokens == alone.prompt_tokens
    first_pad = alone.prompt_ids.index(pipe.lm.config.video_token_id)
    assert got.model_extra["metrics"]["kv_reused_tokens"] > first_pad  # the same clip again: from the prefix cache
    with pytest.raises(APIStatusError) as err:
        ask("data:video/mp4;base64," + base64.b64encode(raw[: len(raw) // 2]).decode())
    assert err.value.status_code == 400 and "messages[0].content[0]: corrupt or unreadable video" in str(err.value)


def test_n_choices_with_a_seed_reproduce(client):
    ask = [{"role": "user", "content": "Tell me a story."}]
    first = chat(client, ask, n=2, seed=7, temperature=1.0, max_tokens=10)
    again = chat(client, ask, n=2, seed=7, temperature=1.0, max_tokens=10)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1] and len(texts) == 2
    assert texts == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 20


def test_32_concurrent_clients_get_their_solo_answers(client):
    asks = [[{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}] for i in range(32)]
    asks[::4] = [[image_message(f"Picture {i}?", png_uri(i))] for i in range(0, 32, 4)]
    solo = [chat(client, m, max_tokens=8 + i % 5).choices[0].message.content for i, m in enumerate(asks)]
    with ThreadPoolExecutor(32) as pool:
        together = list(
            pool.map(
                lambda im: chat(client, im[1], max_tokens=8 + im[0] % 5).choices[0].message.content, enumerate(asks)
            )
        )
    assert together == solo


def test_second_turn_prefills_only_its_new_tokens(client):
    system = {"role": "system", "content": "You are a patient assistant. " * 8}
    turn1 = [system, {"role": "user", "content": "Name a colour."}]
    first = chat(client, turn1, max_tokens=6)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    second = chat(client, turn2, max_tokens=6).model_extra["metrics"]
    assert second["kv_reused_tokens"] >= first.usage.prompt_tokens // 16 * 16 > 0
    assert second["prefill_tokens"] == second["prompt_tokens"] - second["kv_reused_tokens"]
    assert second["prefill_tokens"] < second["prompt_tokens"] - first.usage.prompt_tokens + 16


def test_text_completions_and_models(vl, client, load_tiny, tiny_dir):
    from pipeline import Pipeline, Request
    from stages import DecodeLoop, Prefill

    lm = load_tiny("qwen2-vl", dtype="float64")
    ids = lm.tokenizer("Once upon a time")["input_ids"]
    alone = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}).run_ids(
        ids, Request(max_new_tokens=9, ignore_eos=True)
    )
    got = client.completions.create(
        model=model_id(client), prompt="Once upon a time", max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == alone.text and got.usage.prompt_tokens == len(ids)
    models = httpx.get(vl.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == str(tiny_dir("qwen2-vl"))


# --- errors --------------------------------------------------------------------------------------


def test_bad_requests_get_json_errors_and_harm_nobody(vl, client):
    long_run: dict = {}

    def long_stream() -> None:
        long_run["text"], long_run["chunks"] = streamed(
            client, [{"role": "user", "content": "Go on and on."}], max_tokens=200, extra_body={"ignore_eos": True}
        )

    worker = threading.Thread(target=long_stream)
    worker.start()
    url = vl.url + "/v1/chat/completions"
    user = {"role": "user", "content": "hi"}
    cases = [
        (400, "not valid JSON", {"content": b'{"messages": [', "headers": {"content-type": "application/json"}}),
        (400, "max_tokens", {"json": {"messages": [user], "max_tokens": "ten"}}),
        (400, "messages", {"json": {"messages": "hi"}}),
        (400, "messages is empty", {"json": {"messages": []}}),
        (400, "not valid base64", {"json": {"messages": [image_message("x", "data:image/png;base64,@@@")]}}),
        (
            400,
            "not an image",
            {
                "json": {
                    "messages": [image_message("x", "data:image/png;base64," + base64.b64encode(b"hello" * 9).decode())]
                }
            },
        ),
        (400, "outside serve.allowed_media_dir", {"json": {"messages": [image_message("x", "file:///etc/hostname")]}}),
        (
            400,
            "remote media URLs are disabled",
            {"json": {"messages": [image_message("x", "http://example.com/a.png")]}},
        ),
        (400, "exceed the model's context", {"json": {"messages": [user], "max_tokens": 40000}}),
        (400, "serve.max_tokens", {"json": {"messages": [user], "max_tokens": 200000}}),
        (
            400,
            "without an audio encoder",
            {
                "json": {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "input_audio", "input_audio": {"data": wav_b64(0.2), "format": "wav"}}
                            ],
                        }
                    ]
                }
            },
        ),
        (404, "not found", {"json": {"messages": [user], "model": "gpt-4"}}),
        (413, "serve.max_body_bytes", {"json": {"messages": [user], "pad": "x" * 2_100_000}}),
    ]
    for status, fragment, kwargs in cases:
        response = httpx.post(url, timeout=60, **kwargs)
        body = response.json()
        assert response.status_code == status, (fragment, body)
        assert fragment in body["error"]["message"] and {"message", "type", "code"} <= set(body["error"])
    assert httpx.get(vl.url + "/v1/nothing-here").status_code == 404
    # A file inside the allowed folder is fine.
    ok = chat(client, [image_message("What colour?", f"file://{vl.media / 'red.png'}")], max_tokens=3)
    assert ok.usage.completion_tokens == 3
    worker.join(120)
    assert long_run["chunks"][-1].usage.completion_tokens == 200
    alone, _ = streamed(
        client, [{"role": "user", "content": "Go on and on."}], max_tokens=200, extra_body={"ignore_eos": True}
    )
    assert long_run["text"] == alone


def kv_blocks_used(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^mm_kv_blocks_used (\S+)$", text, re.M).group(1))


def test_disconnect_mid_stream_frees_the_blocks(vl):
    import time

    before = kv_blocks_used(vl.url)
    body = {
        "messages": [{"role": "user", "content": "Talk for a long time."}],
        "stream": True,
        "max_tokens": 5000,
        "ignore_eos": True,
    }
    with httpx.stream("POST", vl.url + "/v1/chat/completions", json=body, timeout=60) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n == 10:
                break
    deadline = time.monotonic() + 10
    while kv_blocks_used(vl.url) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_blocks_used(vl.url) == before


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_blocks(vl):
    import time

    before = kv_blocks_used(vl.url)
    body = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 20000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(vl.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    deadline = time.monotonic() + 10
    while kv_blocks_used(vl.url) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_blocks_used(vl.url) == before


def test_prometheus_metrics(vl, client):
    chat(client, [{"role": "user", "content": "Count."}], max_tokens=4)
    text = httpx.get(vl.url + "/metrics").text
    for name in (
        "mm_requests_total{",
        "mm_prompt_tokens_total",
        "mm_completion_tokens_total",
        "mm_ttft_seconds_bucket",
        "mm_tpot_seconds_bucket",
        "mm_running ",
        "mm_waiting ",
        "mm_kv_blocks_used ",
        "mm_prefix_cache_hits_total",
    ):
        assert name in text, name
    assert re.search(r'mm_requests_total\{endpoint="chat",status="200"\} [1-9]', text)


# --- keys, shutdown, settings ---------------------------------------------------------------------


def test_api_key_and_a_clean_drain_on_sigterm(tiny_dir, tmp_path):
    with serving(tmp_path, f"model.path={tiny_dir('qwen3')}", f"serve.api_key={KEY}", "serve.drain_s=60") as server:
        for key in (None, "wrong"):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            response = httpx.get(server.url + "/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(server.url + "/health").status_code == 200  # not under /v1: open
        client = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        hello = [{"role": "user", "content": "Hello"}]
        prompt_tokens = {
            flag: chat(
                client, hello, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": flag}}
            ).usage.prompt_tokens
            for flag in (True, False)
        }
        assert prompt_tokens[False] > prompt_tokens[True]  # the template's empty think block, as vLLM passes it
        done: dict = {}

        def long_request() -> None:
            done["r"] = chat(
                client, [{"role": "user", "content": "Keep going."}], max_tokens=300, extra_body={"ignore_eos": True}
            )

        worker = threading.Thread(target=long_request)
        worker.start()
        import time

        time.sleep(1.0)
        assert server.stop(signal.SIGTERM, timeout=120) == 0, server.stderr()[-2000:]
        worker.join(10)
    assert done["r"].usage.completion_tokens == 300  # in flight at the signal: finished within serve.drain_s
    log = server.stderr()
    assert "SIGTERM" in log and "stopped" in log and "Traceback" not in log
    assert re.search(r"chatcmpl-\S+ 200 prompt=\d+ generated=300 ttft=", log)


@pytest.mark.slow  # a second process end to end (python -m pytest -m slow)
def test_busy_port_and_bad_settings_fail_in_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = run_cli("mode=serve", f"serve.port={port}", f"hydra.run.dir={tmp_path}")
    assert busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1
    bad = run_cli(
        "mode=serve", f"serve.port={free_port()}", "serve.allowed_media_dir=/no/such/dir", f"hydra.run.dir={tmp_path}"
    )
    assert bad.returncode == 2 and "serve.allowed_media_dir" in bad.stderr


def test_openai_client_errors_are_typed(client):
    with pytest.raises(APIStatusError) as err:
        chat(client, [], max_tokens=3)
    assert err.value.status_code == 400 and "messages is empty" in str(err.value)


# --- the event loop and the device ---------------------------------------------------------------


def test_the_event_loop_never_touches_the_device(load_tiny, monkeypatch):
    """In process: requests (chat, text completion, a stream) handled on the event loop's thread
    while this thread drives the engine, as ``mode=serve`` does. Every device call (synchronising,
    reading and resetting peak memory: simulated as on a GPU) and every submission to the engine
    happen off the loop, so no open stream waits for the device."""
    import asyncio

    import torch

    from pipeline import Pipeline, metrics
    from pipeline.serve.app import create_app
    from pipeline.serve.protocol import ServeSettings
    from stages import DecodeLoop, Prefill, Tokenize

    calls: list[tuple[str, int]] = []

    def recorded(name: str, result=None):
        def call(*args, **kwargs):
            calls.append((name, threading.get_ident()))
            return result

        return call

    monkeypatch.setattr(metrics, "_is_cuda", lambda device: True)
    for name, result in (("synchronize", None), ("reset_peak_memory_stats", None), ("max_memory_allocated", 0)):
        monkeypatch.setattr(torch.cuda, name, recorded(name, result))
    submit = Pipeline.submit

    def submitting(self, *args, **kwargs):
        calls.append(("submit", threading.get_ident()))
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "submit", submitting)
    pipe = Pipeline(
        load_tiny("qwen3"), {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=2 << 20
    )
    app = create_app(pipe, ServeSettings(model_name="tiny"))
    loop_thread, done, statuses = {}, threading.Event(), []

    async def clients() -> None:
        loop_thread["id"] = threading.get_ident()
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
            replies = await asyncio.gather(
                *[http.post("/v1/chat/completions", json=chat) for _ in range(3)],
                http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5}),
                http.post("/v1/chat/completions", json={**chat, "stream": True}),
            )
        statuses.extend(r.status_code for r in replies)

    def serve() -> None:
        try:
            asyncio.run(clients())
        finally:
            done.set()

    threading.Thread(target=serve, daemon=True).start()
    pipe.engine.drive(done.is_set, timeout=120)
    assert statuses == [200] * 5
    assert {"submit", "synchronize", "reset_peak_memory_stats"} <= {name for name, _ in calls}
    assert [name for name, thread in calls if thread == loop_thread["id"]] == []
