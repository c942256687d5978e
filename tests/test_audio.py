"""Qwen2-Audio: greedy output equals transformers' generate(do_sample=False) on the same audio,
clips at other rates are resampled, long clips split (never truncated), bad audio is one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
import torchaudio.functional as AF

from conftest import generate_oracle, on_device, run_cli
from pipeline import Pipeline, Request, UserError
from stages import AudioEncoder, DecodeLoop, Prefill, Sampler, Tokenize

N = 10
RATE = 16_000
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def tone(freq: float, seconds: float, rate: int = RATE, amp: float = 0.4) -> torch.Tensor:
    """A sine with a slow amplitude wobble, so different clips give different features."""
    t = torch.arange(int(round(seconds * rate)), dtype=torch.float64) / rate
    return (amp * (0.6 + 0.4 * torch.sin(2 * torch.pi * 3 * t)) * torch.sin(2 * torch.pi * freq * t)).float()


def make_pipe(lm, long_audio: str = "split", batch_size: int | None = None) -> Pipeline:
    return Pipeline(
        lm,
        {
            "tokenize": Tokenize(long_audio=long_audio),
            "audio_encoder": AudioEncoder(batch_size=batch_size),
            "prefill": Prefill(),
            "decode": DecodeLoop(Sampler()),
        },
    )


def processor_inputs(lm, waves: list[torch.Tensor], prompt: str) -> dict:
    """What a transformers user writes: one user message (audio items first), the processor at 16 kHz."""
    content = [{"type": "audio", "audio": f"clip{i}.wav"} for i in range(len(waves))]
    messages = [{"role": "user", "content": content + [{"type": "text", "text": prompt}]}]
    text = lm.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(lm.processor(text=[text], audio=[w.numpy() for w in waves], sampling_rate=RATE, return_tensors="pt"))


def oracle(lm, waves: list[torch.Tensor], prompt: str, n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) from model.generate on the same 16 kHz waveforms."""
    inputs = processor_inputs(lm, waves, prompt)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    return ids[0].tolist(), generate_oracle(lm, ids, n, **inputs)


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen2-audio")


# ---------------------------------------------------------------- token-exact against generate


def test_one_clip_matches_generate(lm):
    wave = tone(440, 2.0)
    result = make_pipe(lm).run(Request(prompt="What do you hear?", audios=[(wave, RATE)], max_new_tokens=N))
    prompt_ids, generated = oracle(lm, [wave], "What do you hear?")
    assert result.prompt_ids == prompt_ids
    assert result.token_ids == generated
    m = result.metrics
    assert m["audio_seconds"] == pytest.approx(2.0)
    assert m["audio_tokens"] == prompt_ids.count(lm.config.audio_token_id) == 50
    assert m["stages"]["audio_encoder"]["seconds"] > 0 and m["audio_rtf"] > 0


def test_two_clips_of_different_lengths_match_generate(lm):
    a, b = tone(330, 1.3), tone(880, 0.6, amp=0.2)
    result = make_pipe(lm).run(Request(prompt="Compare them.", audios=[(a, RATE), (b, RATE)], max_new_tokens=N))
    prompt_ids, generated = oracle(lm, [a, b], "Compare them.")
    assert result.prompt_ids == prompt_ids
    assert result.token_ids == generated
    assert result.metrics["audio_seconds"] == pytest.approx(1.9)


def test_clip_at_another_rate_is_resampled_to_the_model_rate(lm, tmp_path):
    # In memory at 44.1 kHz, and from a 22.05 kHz file given by path: both reach the model at 16 kHz.
    array = tone(523, 1.0, rate=44_100)
    path = tmp_path / "speech22k.wav"
    sf.write(path, tone(262, 1.5, rate=22_050).numpy(), 22_050, subtype="FLOAT")
    request = Request(prompt="Describe.", audios=[(array, 44_100), str(path)], max_new_tokens=N)
    result = make_pipe(lm).run(request)
    from_file = torch.from_numpy(sf.read(path, dtype="float32")[0])
    expected = [AF.resample(array, 44_100, RATE), AF.resample(from_file, 22_050, RATE)]
    prompt_ids, generated = oracle(lm, expected, "Describe.")
    assert result.prompt_ids == prompt_ids
    assert result.token_ids == generated
    assert result.metrics["audio_seconds"] == pytest.approx(2.5, abs=1e-3)  # seconds, not samples at 16 kHz


def test_audio_encoder_alone_matches_what_the_model_forward_merges(lm):
    waves = [tone(300, 1.1), tone(700, 2.4, amp=0.3)]
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    inputs = processor_inputs(lm, waves, "Listen.")
    hook = lm.model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.inference_mode():
            lm.model(**on_device(lm, **inputs))
    finally:
        hook.remove()
    for batch_size in (None, 1):  # all windows at once, or one by one: same embeddings
        pipe = make_pipe(lm, batch_size=batch_size)
        ctx = pipe.context(Request(prompt="Listen.", audios=[(w, RATE) for w in waves]))
        with torch.inference_mode():
            pipe.stages["tokenize"](ctx)
            pipe.stages["audio_encoder"](ctx)
            text = lm.model.get_input_embeddings()(ctx.input_ids)
        assert ctx.input_ids[0].tolist() == inputs["input_ids"][0].tolist()
        torch.testing.assert_close(ctx.inputs_embeds, captured["embeds"], rtol=0, atol=1e-5)
        slots = ctx.input_ids[0] == lm.config.audio_token_id
        assert not torch.allclose(ctx.inputs_embeds[0, slots], text[0, slots])  # audio really was written


def test_text_only_prompt_skips_the_audio_encoder(lm):
    result = make_pipe(lm).run(Request(prompt="Just text.", max_new_tokens=N))
    assert "audio_encoder" not in result.metrics["stages"] and "audio_seconds" not in result.metrics
    assert result.token_ids == generate_oracle(lm, torch.tensor([result.prompt_ids]), N)


# ---------------------------------------------------------------- long clips


def test_long_clip_is_split_into_ordered_chunks_never_truncated(lm):
    wave = tone(200, 61.0, amp=0.3)
    wave[-RATE:] = tone(1500, 1.0, amp=0.8)  # the last second differs: it must reach the model
    request = Request(prompt="Summarise.", audios=[(wave, RATE)], max_new_tokens=4)
    pipe = make_pipe(lm)
    ctx = pipe.run_context(request)
    result = pipe.result(ctx)
    chunks = [w for w, _ in ctx.request.audios]
    assert len(chunks) == 3 and all(c.numel() <= 30 * RATE for c in chunks)
    assert torch.equal(torch.cat(chunks), wave)  # every sample, in order
    assert ctx.extras["prompt_text"].count("<|AUDIO|>") == 3 and "Audio 3:" in ctx.extras["prompt_text"]
    assert result.metrics["audio_seconds"] == pytest.approx(61.0)
    prompt_ids, generated = oracle(lm, chunks, "Summarise.", n=4)
    assert result.prompt_ids == prompt_ids
    assert result.token_ids == generated
    assert request.audios[0][0] is wave  # the caller's request is not modified


def test_exactly_one_window_is_not_split_and_messages_get_one_item_per_chunk(lm):
    pipe = make_pipe(lm)
    ctx = pipe.tokenize(Request(prompt="x", audios=[(tone(100, 30.0), RATE)]))
    assert len(ctx.request.audios) == 1
    messages = [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}, {"type": "text", "text": "Hi"}]}]
    ctx = pipe.tokenize(Request(messages=messages, audios=[(tone(100, 45.0), RATE)]))
    assert len(ctx.request.audios) == 2
    assert "Audio 2:" in ctx.extras["prompt_text"]
    assert len(messages[0]["content"]) == 2  # the caller's messages are left alone


def test_long_clip_refused_when_asked(lm):
    with pytest.raises(UserError, match=r"audio input 1: 31\.0 s of audio is longer than the encoder's 30 s window"):
        make_pipe(lm, long_audio="error").run(Request(prompt="x", audios=[(tone(100, 31.0), RATE)]))
    with pytest.raises(UserError, match="media.long_audio must be one of split, error"):
        make_pipe(lm, long_audio="truncate").run(Request(prompt="x", audios=[(tone(100, 1.0), RATE)]))


# ---------------------------------------------------------------- KV cache


def test_cache_reuse_skips_the_encoder_and_keeps_tokens_exact(lm):
    pipe = make_pipe(lm)
    cache = pipe.new_cache()
    first = pipe.run(Request(prompt="Again?", audios=[(tone(440, 1.0), RATE)], max_new_tokens=N), cache)
    again = pipe.run(Request(prompt="Again?", audios=[(tone(440, 1.0), RATE)], max_new_tokens=N), cache)
    assert again.token_ids == first.token_ids
    assert again.metrics["kv_reused_tokens"] == again.prompt_tokens - 1
    assert again.metrics["audio_seconds"] == 0  # the clip was already in the cache: not encoded again
    # Another clip of the same length has the same placeholders but a different content hash.
    other = tone(220, 1.0)
    switched = pipe.run(Request(prompt="Again?", audios=[(other, RATE)], max_new_tokens=N), cache)
    assert switched.metrics["kv_reused_tokens"] == switched.prompt_ids.index(lm.config.audio_token_id)
    assert switched.metrics["audio_seconds"] == pytest.approx(1.0)
    assert switched.token_ids == oracle(lm, [other], "Again?")[1]


def test_follow_up_turn_encodes_only_the_new_clip(lm):
    a, b = tone(440, 1.0), tone(660, 0.8)

    def user(text: str) -> dict:
        return {"role": "user", "content": [{"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": text}]}

    pipe = make_pipe(lm)
    cache = pipe.new_cache()
    first = pipe.run(Request(messages=[user("First?")], audios=[(a, RATE)], max_new_tokens=N), cache)
    history = [user("First?"), {"role": "assistant", "content": first.text}, user("And this one?")]
    follow = Request(messages=history, audios=[(a, RATE), (b, RATE)], max_new_tokens=N)
    second = pipe.run(follow, cache)
    fresh = Pipeline(lm, pipe.stages, kv_memory=7 << 20).run(follow)  # a pool of its own: nothing cached
    assert second.token_ids == fresh.token_ids
    assert second.metrics["audio_seconds"] == pytest.approx(0.8)  # clip a came from the cache
    assert fresh.metrics["audio_seconds"] == pytest.approx(1.8)
    assert second.metrics["audio_tokens"] == fresh.metrics["audio_tokens"]


# ---------------------------------------------------------------- bad input


def wav_with(path, fmt_code: int, bits: int, data: bytes = b"\x00" * 600) -> str:
    """A hand-made WAV header (format code, bits per sample), for formats libsndfile refuses."""
    block = bits // 8
    fmt = struct.pack("<HHIIHH", fmt_code, 1, RATE, RATE * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return str(path)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("bad_audio")
    good = d / "good.wav"
    sf.write(good, tone(440, 0.5).numpy(), RATE, subtype="PCM_16")
    (d / "notes.wav").write_text("these are words, not sound\n" * 10)
    corrupt = bytearray(good.read_bytes())
    corrupt[20:36] = b"\xff" * 16  # the whole fmt chunk body
    (d / "corrupt.wav").write_bytes(bytes(corrupt))
    sf.write(d / "empty.wav", np.zeros(0, np.float32), RATE)
    return {
        "missing": (str(d / "missing.wav"), "not found"),
        "not audio": (str(d / "notes.wav"), "not an audio file"),
        "corrupt header": (str(d / "corrupt.wav"), "malformed WAV header"),
        "empty": (str(d / "empty.wav"), "no samples"),
        "unsupported format": (wav_with(d / "pcm48.wav", 1, 48), "unsupported"),
        "unknown codec": (wav_with(d / "codec.wav", 0x1234, 16), "unsupported"),
    }


@pytest.mark.parametrize(
    "case", ["missing", "not audio", "corrupt header", "empty", "unsupported format", "unknown codec"]
)
def test_bad_audio_file_is_one_line_user_error(lm, bad_files, case):
    path, words = bad_files[case]
    with pytest.raises(UserError) as err:
        make_pipe(lm).run(Request(prompt="x", audios=[path]))
    message = str(err.value)
    assert message.startswith(path) and words in message and "\n" not in message


@pytest.mark.parametrize(
    "item, words",
    [
        ((torch.zeros(0), RATE), "no samples"),
        ((np.zeros(RATE, np.int16), RATE), "unsupported sample format int16"),
        ((torch.zeros(2, RATE), RATE), "must be 1-D"),
        ((torch.full((RATE,), float("nan")), RATE), "NaN"),
        ((torch.zeros(RATE), 0), "sample rate must be a positive integer"),
        ((torch.zeros(RATE), 16000.5), "sample rate must be a positive integer"),
        (([0.0] * 100, RATE), "must be a numpy array or a torch tensor"),
        (b"RIFF", "expected a file path or a (waveform, sample_rate) pair"),
        ((torch.full((100,), 0.1), RATE), "too short"),
    ],
)
def test_bad_waveform_is_one_line_user_error(lm, item, words):
    with pytest.raises(UserError) as err:
        make_pipe(lm).run(Request(prompt="x", audios=[item]))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_placeholder_typed_in_the_prompt_is_refused(lm):
    with pytest.raises(UserError, match="2 audio placeholder"):
        make_pipe(lm).run(Request(prompt="what is <|AUDIO|>?", audios=[(tone(440, 0.5), RATE)]))


def test_audio_to_a_model_without_audio_encoder_is_refused(load_tiny):
    vl = load_tiny("qwen2-vl")
    with pytest.raises(UserError, match="qwen2-vl model without an audio encoder: cannot take audio input"):
        make_pipe(vl).run(Request(prompt="x", audios=[(tone(440, 0.5), RATE)]))


# ---------------------------------------------------------------- command line


@pytest.mark.slow  # the CLI path of audio; the pipeline's audio metrics are checked in-process
def test_cli_hears_a_wav_and_reports_audio_metrics(tiny_dir, load_tiny, tmp_path):
    proc = run_cli(
        f"model.path={tiny_dir('qwen2-audio')}",
        "input=examples/tone.wav",
        "prompt=What do you hear?",
        f"max_new_tokens={N}",
        "model.dtype=float32",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    m = result["metrics"]
    assert m["audio_seconds"] == pytest.approx(2.0)
    assert m["stages"]["audio_encoder"]["seconds"] > 0
    assert m["audio_rtf"] == pytest.approx(m["stages"]["audio_encoder"]["seconds"] / m["audio_seconds"])
    assert "audio_rtf" in proc.stderr
    lm = load_tiny("qwen2-audio")
    wave = torch.from_numpy(sf.read("examples/tone.wav", dtype="float32")[0])
    prompt_ids, generated = oracle(lm, [wave], "What do you hear?")
    assert result["prompt_ids"] == prompt_ids and result["token_ids"] == generated


@pytest.mark.slow  # suite time; in-process: the bad_files cases of the audio loader
def test_cli_bad_audio_is_one_line_exit_2(tiny_dir, bad_files, tmp_path):
    path, words = bad_files["corrupt header"]
    proc = run_cli(f"model.path={tiny_dir('qwen2-audio')}", f"input={path}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and words in lines[0]
    assert proc.stdout == ""


def test_long_audio_option_flows_from_the_config(lm):
    from hydra import compose, initialize_config_dir

    from pipeline.cli.assemble import stages_from_cfg
    from pipeline.cli.settings import check

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        default = compose("config")
        refuse = compose("config", overrides=["media.long_audio=error"])
        bogus = compose("config", overrides=["media.long_audio=truncate"])
    assert list(default.stages).index("audio_encoder") == list(default.stages).index("prefill") - 1
    assert stages_from_cfg(default)["tokenize"].long_audio == "split"
    stages = stages_from_cfg(refuse)
    assert stages["tokenize"].long_audio == "error"
    with pytest.raises(UserError, match="longer than the encoder's 30 s window"):
        Pipeline(lm, stages).run(Request(prompt="x", audios=[(tone(100, 30.5), RATE)]))
    with pytest.raises(UserError, match="media.long_audio must be split or error"):
        check(bogus)
