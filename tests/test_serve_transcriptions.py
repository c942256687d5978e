"""``POST /v1/audio/transcriptions`` through the official ``openai`` client, and ``audio_url`` parts on
chat: the transcript is the served pipeline's own answer to the model's transcription prompt
(the same text a chat completion gives for that prompt and clip), the formats parse with the
client, and what the endpoint does not do is a 400 that names it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import soundfile as sf
from openai import OpenAI

from serving import serving_tiny

MAX_TOKENS = 6


def wav_bytes(seconds: float = 1.0, rate: int = 16000, hz: float = 440.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """The tiny Qwen2-Audio (its Instruct chat template), answers MAX_TOKENS tokens long."""
    tmp = tmp_path_factory.mktemp("serve-asr")
    media = tmp / "media"
    media.mkdir()
    (media / "tone.wav").write_bytes(wav_bytes())
    with serving_tiny(
        tmp,
        tiny_dir("qwen2-audio"),
        "qwen2-audio",
        f"max_new_tokens={MAX_TOKENS}",
        f"serve.allowed_media_dir={media}",
        "serve.max_audio_s=5",
    ) as srv:
        srv.media = media
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def wav(server):
    return server.media / "tone.wav"


def chat_answer(client: OpenAI, audio_part: dict, text: str):
    """The chat completion for the clip then ``text`` in one user turn (greedy, the default length)."""
    content = [audio_part, {"type": "text", "text": text}]
    return client.chat.completions.create(
        model="qwen2-audio", messages=[{"role": "user", "content": content}], temperature=0
    )


def input_audio(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def test_transcript_is_the_pipelines_answer_in_every_format(client, wav):
    chat = chat_answer(client, input_audio(wav.read_bytes()), "Transcribe the audio into text.")
    expected = chat.choices[0].message.content
    got = client.audio.transcriptions.create(model="qwen2-audio", file=open(wav, "rb"))
    assert got.text == expected
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens == MAX_TOKENS
    plain = client.audio.transcriptions.create(model="qwen2-audio", file=open(wav, "rb"), response_format="text")
    assert plain == expected
    verbose = client.audio.transcriptions.create(
        model="qwen2-audio", file=open(wav, "rb"), response_format="verbose_json", temperature=0
    )
    assert verbose.text == expected and verbose.duration == pytest.approx(1.0)
    assert verbose.language == "unknown"  # none asked for, none detected
    (segment,) = verbose.segments
    assert (segment.start, segment.end, segment.text) == (0.0, verbose.duration, expected)
    assert len(segment.tokens) == MAX_TOKENS and segment.avg_logprob < 0


def test_language_and_prompt_go_into_the_prompt(client, server, wav):
    english = chat_answer(client, input_audio(wav.read_bytes()), "Transcribe the English audio into text.")
    got = client.audio.transcriptions.create(model="qwen2-audio", file=open(wav, "rb"), language="en")
    assert got.text == english.choices[0].message.content
    assert got.usage.input_tokens == english.usage.prompt_tokens
    plain = client.audio.transcriptions.create(model="qwen2-audio", file=open(wav, "rb"))
    assert got.usage.input_tokens > plain.usage.input_tokens  # "English" is in the prompt
    verbose = client.audio.transcriptions.create(
        model="qwen2-audio", file=open(wav, "rb"), language="en", response_format="verbose_json"
    )
    assert verbose.language == "english"
    assert "language=en " in server.stderr()
    guided = chat_answer(
        client, input_audio(wav.read_bytes()), "Transcribe the audio into text.\nContext: Ada Lovelace spoke."
    )
    got = client.audio.transcriptions.create(model="qwen2-audio", file=open(wav, "rb"), prompt="Ada Lovelace spoke.")
    assert got.text == guided.choices[0].message.content
    assert got.usage.input_tokens == guided.usage.prompt_tokens


def test_audio_url_parts_equal_input_audio(client, wav):
    data = wav.read_bytes()
    expected = chat_answer(client, input_audio(data), "What do you hear?").choices[0].message.content
    uri = "data:audio/wav;base64," + base64.b64encode(data).decode()
    for url in (uri, wav.as_uri()):
        got = chat_answer(client, {"type": "audio_url", "audio_url": {"url": url}}, "What do you hear?")
        assert got.choices[0].message.content == expected, url


def post(server, files=None, **data) -> httpx.Response:
    return httpx.post(server.url + "/v1/audio/transcriptions", files=files, data=data, timeout=60)


def test_refusals_name_what_they_refuse(server, wav):
    good = {"file": ("tone.wav", wav.read_bytes(), "audio/wav")}
    cases = [
        ({"file": ("x.wav", b"RIFF not really a wave file", "audio/wav")}, {}, "file: "),
        ({"file": ("x.wav", b"", "audio/wav")}, {}, "file: empty"),
        ({"file": ("long.wav", wav_bytes(6.0), "audio/wav")}, {}, "serve.max_audio_s"),
        (None, {"model": "qwen2-audio"}, "file: missing"),
        (good, {"response_format": "srt"}, "'srt'"),
        (good, {"response_format": "vtt"}, "'vtt'"),
        (good, {"timestamp_granularities[]": "word"}, "timestamp_granularities"),
        (good, {"stream": "true", "chunking_strategy": "auto"}, "chunking_strategy, stream"),
        (good, {"language": "xx"}, "language: 'xx'"),
        (good, {"temperature": "3"}, "temperature"),
        (good, {"prompt": "word " * 300}, "prompt: "),
    ]
    for files, data, fragment in cases:
        response = post(server, files, **data)
        assert response.status_code == 400, (fragment, response.text)
        message = response.json()["error"]["message"]
        assert fragment in message and "\n" not in message, (fragment, message)
    response = post(server, good, model="whisper-1")
    assert response.status_code == 404 and "whisper-1" in response.json()["error"]["message"]
    remote = {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:1/a.wav"}}
    body = {"messages": [{"role": "user", "content": [remote]}]}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "remote media URLs are disabled" in response.json()["error"]["message"]


# --- in-process: a model without an audio encoder, and a base checkpoint -----------------------


def serve_in_process(pipe, requests) -> list[httpx.Response]:
    """``requests`` (httpx.AsyncClient.post keyword arguments) against the app, the engine driven here."""
    from pipeline.serve.app import create_app
    from pipeline.serve.protocol import ServeSettings

    app = create_app(pipe, ServeSettings(model_name="tiny", default_max_tokens=MAX_TOKENS))
    done, replies = threading.Event(), []

    async def clients() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
            for kwargs in requests:
                replies.append(await http.post(**kwargs))

    def run() -> None:
        try:
            asyncio.run(clients())
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    pipe.engine.drive(done.is_set, timeout=120)
    return replies


def test_a_model_without_an_audio_encoder_is_refused(load_tiny):
    from pipeline import Pipeline
    from stages import DecodeLoop, Prefill, Tokenize

    pipe = Pipeline(
        load_tiny("qwen3"), {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=2 << 20
    )
    uri = "data:audio/wav;base64," + base64.b64encode(wav_bytes(0.2)).decode()
    part = {"type": "audio_url", "audio_url": {"url": uri}}
    replies = serve_in_process(
        pipe,
        [
            {"url": "/v1/audio/transcriptions", "files": {"file": ("a.wav", wav_bytes(0.2), "audio/wav")}},
            {"url": "/v1/chat/completions", "json": {"messages": [{"role": "user", "content": [part]}]}},
        ],
    )
    for reply in replies:
        assert reply.status_code == 400 and "without an audio encoder" in reply.json()["error"]["message"]
    assert replies[0].json()["error"]["message"].startswith("file: ")


def test_a_base_checkpoint_gets_its_cards_raw_prompt(server):
    """Without a chat template that places audio (Qwen2-Audio-7B), the card's task prompt is fed
    as it is: the answer is transformers' greedy generate on that prompt."""
    import copy

    import torch

    from pipeline import Pipeline
    from pipeline.serve.transcriptions import PROMPTS, asr_prompt
    from stages import AudioEncoder, DecodeLoop, Prefill, Tokenize

    processor = copy.copy(server.lm.processor)
    processor.chat_template = None
    lm = dataclasses.replace(server.lm, processor=processor)
    stages = {"tokenize": Tokenize(), "audio_encoder": AudioEncoder(), "prefill": Prefill(), "decode": DecodeLoop()}
    pipe = Pipeline(lm, stages, kv_memory=8 << 20)
    upload = {"file": ("a.wav", wav_bytes(), "audio/wav")}
    url = "/v1/audio/transcriptions"
    got, with_prompt, with_language = serve_in_process(
        pipe,
        [
            {"url": url, "files": upload},
            {"url": url, "files": upload, "data": {"prompt": "Ada"}},
            {"url": url, "files": upload, "data": {"language": "en"}},  # the tiny vocabulary has no <|en|>
        ],
    )
    assert got.status_code == 200, got.text
    raw = "<|audio_bos|><|AUDIO|><|audio_eos|>Detect the language and recognize the speech:"
    wave, _ = sf.read(io.BytesIO(wav_bytes()), dtype="float32")
    inputs = processor(text=[raw], audio=[wave], sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        out = lm.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    assert got.json()["text"] == lm.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True)
    assert got.json()["usage"]["input_tokens"] == prompt_len
    assert with_prompt.status_code == 400 and "prompt: " in with_prompt.json()["error"]["message"]
    assert with_language.status_code == 400 and "<|en|>" in with_language.json()["error"]["message"]
    assert asr_prompt(lm) is PROMPTS["qwen2_audio"]  # the table is keyed by the config's model type
    omni = SimpleNamespace(config=SimpleNamespace(model_type="qwen2_5_omni"))
    assert asr_prompt(omni).system == "You are a speech recognition model."
    assert asr_prompt(SimpleNamespace(config=SimpleNamespace(model_type="gemma3n"))).instruction.startswith(
        "Transcribe"
    )
