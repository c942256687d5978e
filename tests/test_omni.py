"""Qwen2.5-Omni thinker: text, images, audio and video (heard with its own track or not) in one
prompt answer exactly like the thinker's own ``generate()``: alone, batched, in a chat turn that
reuses the cache, in nf4 with both towers unquantised, and from the command line.

Oracle: the model's own processor on the same media (a heard video's track given as that video's
audio, which transformers would decode itself with torchcodec), then ``generate(do_sample=False)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import av
import bitsandbytes as bnb
import numpy as np
import pytest
import soundfile as sf
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from PIL import Image

from conftest import ROOT, generate_oracle, run_cli
from pipeline import Pipeline, Request, UserError
from pipeline.cli.assemble import stages_from_cfg
from pipeline.frontends.chat_session import ChatSession
from pipeline.context import Context
from pipeline.families.qwen2_vl import Qwen2VLFamily
from pipeline.media import load_audio, load_image, load_video, split_audio
from pipeline.kv import BlockPool
from stages import AudioEncoder, DecodeLoop, Prefill, Tokenize, VisionEncoder
from test_engine import submit_staggered
from test_quant import linears

FAMILY = "qwen2.5-omni"
N = 8
PROMPT = "What is going on?"
RATE = 16_000


def picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def tone(hz: float, seconds: float) -> torch.Tensor:
    t = torch.arange(int(seconds * RATE)) / RATE
    return (0.3 * torch.sin(2 * torch.pi * hz * t)).float()


A = picture(160, 120, 1)
HUM = tone(220, 1.5)


def write_clip(path: Path, seconds: int = 4, fps: int = 4, hz: float | None = None) -> Path:
    """Noise frames (a box moving right) at ``fps``, and a 16-bit PCM tone as its track when ``hz``."""
    rng = np.random.default_rng(7)
    with av.open(str(path), "w", format="mov") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        sound = None if hz is None else out.add_stream("pcm_s16le", rate=RATE, layout="mono")
        for i in range(seconds * fps):
            frame = rng.integers(0, 60, (48, 64, 3), dtype=np.uint8)
            frame[10:24, 3 * i : 3 * i + 12] = (240, 20, 20)
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())
        if sound is not None:
            samples = (tone(hz, seconds).numpy() * 32767).round().astype(np.int16)[None]
            chunk = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            chunk.sample_rate, chunk.pts = RATE, 0
            out.mux(sound.encode(chunk))
            out.mux(sound.encode())
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("omni")
    A.save(tmp / "a.png")
    sf.write(tmp / "hum.wav", HUM.numpy(), RATE)
    return {
        "clip": write_clip(tmp / "clip.mov", hz=330),
        "silent": write_clip(tmp / "silent.mov"),
        "png": tmp / "a.png",
        "wav": tmp / "hum.wav",
    }


@pytest.fixture(scope="module")
def clip(files):
    """4 s, 4 frames at 1 fps: two temporal patches 2 s apart, so its 100 audio tokens (25 a
    second) interleave in two chunks: video, audio, video, audio."""
    return load_video(files["clip"], fps=1)


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny(FAMILY)


def make_pipe(lm, heard: bool = False, chunk: int | None = None, **engine) -> Pipeline:
    return Pipeline(
        lm,
        {
            "tokenize": Tokenize(use_audio_in_video=heard),
            "vision_encoder": VisionEncoder(),
            "audio_encoder": AudioEncoder(),
            "prefill": Prefill(chunk_size=chunk),
            "decode": DecodeLoop(),
        },
        **engine,
    )


def request(kinds, images=(), audios=(), videos=(), text: str = PROMPT) -> Request:
    return Request(
        prompt=text,
        images=list(images),
        audios=[(w, RATE) for w in audios],
        videos=list(videos),
        media_order=list(kinds),
        max_new_tokens=N,
        ignore_eos=True,
    )


def oracle(lm, kinds=(), images=(), audios=(), videos=(), heard: bool = False, messages=None):
    """(prompt ids, greedy tokens): the processor on the rendered conversation and its media, then
    the thinker's ``generate``; a heard video's track is the audio input of that video."""
    content = [{"type": k} for k in kinds] + [{"type": "text", "text": PROMPT}]
    messages = messages or [{"role": "user", "content": content}]
    text = lm.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    parts = [p["type"] for m in messages if isinstance(m["content"], list) for p in m["content"]]
    slots, k = [], 0
    for p in parts:
        if p == "audio":
            slots.append(None)
        elif p == "video" and heard:
            slots.append(k)
            k += 1
    waves = iter(audios)
    clips = [(next(waves) if k is None else videos[k].audio[0]).numpy() for k in slots]
    kwargs: dict = {"images": list(images) or None}
    if videos:
        kwargs.update(
            videos=[v.frames for v in videos],
            fps=videos[0].sampled_fps,
            do_sample_frames=False,
            cap_pixels_per_frame=True,
        )
    if clips:
        kwargs.update(audio=clips, sampling_rate=RATE)
    if heard:
        kwargs.update(load_audio_from_video=True, audio_from_video_indices=slots)
    inputs = dict(lm.processor(text=[text], return_tensors="pt", **kwargs))
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    return ids[0].tolist(), generate_oracle(lm, ids, N, ignore_eos=True, use_audio_in_video=heard, **inputs)


def forget(lm) -> None:
    """Drop the prefix cache the model's pipelines share, so the next run computes everything."""
    for obj in lm.__dict__.get("_mm_shared", {}).values():
        if isinstance(obj, BlockPool):
            obj.clear_prefix_cache()


def runs(ids: list[int], keep: set[int]) -> list[int]:
    """Token ids of the runs of ``keep`` tokens, one entry per run (``[V, A, V, A]``)."""
    out = []
    for i, t in enumerate(ids):
        if t in keep and (i == 0 or ids[i - 1] != t):
            out.append(t)
    return out


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("kinds", [[], ["image"], ["audio"]], ids=["text", "image", "audio"])
def test_one_medium_matches_generate(lm, kinds):
    media = {"images": [A] if "image" in kinds else [], "audios": [HUM] if "audio" in kinds else []}
    result = make_pipe(lm).run(request(kinds, **media))
    assert (result.prompt_ids, result.token_ids) == oracle(lm, kinds, **media)


@pytest.mark.parametrize(
    "kinds, heard",
    [(["audio", "image", "video"], False), (["video", "image", "audio"], True)],
    ids=["watched", "heard"],
)
def test_audio_image_video_in_one_prompt_match_generate(lm, clip, kinds, heard):
    result = make_pipe(lm, heard).run(request(kinds, [A], [HUM], [clip]))
    prompt_ids, tokens = oracle(lm, kinds, [A], [HUM], [clip], heard=heard)
    assert (result.prompt_ids, result.token_ids) == (prompt_ids, tokens)
    config, m = lm.config, result.metrics
    video, audio, image = config.video_token_id, config.audio_token_id, config.image_token_id
    order = runs(prompt_ids, {video, audio, image})
    assert order == ([video, audio, video, audio, image, audio] if heard else [audio, image, video])
    assert m["video_tokens"] == prompt_ids.count(video) and m["image_tokens"] == prompt_ids.count(image)
    own = prompt_ids.count(audio) - (100 if heard else 0)  # the clip given on its own, not the track
    assert m["audio_tokens"] == own > 0 and m["audio_seconds"] == pytest.approx(1.5)


def test_heard_video_positions_put_sound_and_frames_on_one_time_axis(lm, clip):
    """The track's tokens count 25 a second from the video's start, as its frames do (2 s apart)."""
    pipe = make_pipe(lm, heard=True)
    ctx = pipe.tokenize(request(["video"], videos=[clip]))
    pos = lm.family.prompt_positions(ctx, 0)[1, 0].tolist()  # the temporal row
    ids = ctx.input_ids[0].tolist()
    frames = [p for p, t in enumerate(ids) if t == lm.config.video_token_id]
    sound = [p for p, t in enumerate(ids) if t == lm.config.audio_token_id]
    assert len(sound) == 100 and len(frames) % 2 == 0
    second_patch = frames[len(frames) // 2]
    assert pos[sound[0]] == pos[frames[0]] and pos[sound[50]] == pos[second_patch] == pos[frames[0]] + 50
    assert sound[0] < second_patch < sound[50]  # interleaved: chunk 1's sound before chunk 2's frames


def test_long_clip_is_split_in_the_order_given(lm):
    """Over the tiny extractor's 30 s window: two chunks, which the prompt order follows."""
    long = tone(150, 31.0)
    result = make_pipe(lm).run(request(["audio", "image"], [A], [long]))
    chunks = split_audio(long, RATE, 30.0)
    assert (result.prompt_ids, result.token_ids) == oracle(lm, ["audio", "audio", "image"], [A], chunks)


# --------------------------------------------------------------------------- engine, chat, nf4


def test_batched_requests_each_get_their_solo_answer(lm, clip):
    """Packed with the others and prefilled in chunks whose borders fall inside the heard video."""
    requests = [
        request([], text="Hello there."),
        request(["image"], [A]),
        request(["audio"], audios=[HUM]),
        request(["video", "audio"], audios=[HUM], videos=[clip]),
        request(["image", "audio"], [A], [HUM]),
    ]
    batched = submit_staggered(make_pipe(lm, heard=True, chunk=48, max_seqs=5), requests)
    forget(lm)  # solo runs encode and prefill everything again
    solo = [make_pipe(lm, heard=True, max_seqs=1).run(r).token_ids for r in requests]
    assert [r.token_ids for r in batched] == solo


def test_chat_turn_reuses_the_cache_and_equals_a_fresh_run(lm, clip):
    chat = ChatSession(make_pipe(lm, heard=True), max_new_tokens=N, ignore_eos=True)
    media = {"images": [A], "audios": [HUM], "videos": [clip]}
    first = chat.send(PROMPT, images=[A], audios=[(HUM, RATE)], videos=[clip])
    assert (first.prompt_ids, first.token_ids) == oracle(lm, messages=chat.messages[:-1], heard=True, **media)
    second = chat.send("And after that?")
    assert (second.prompt_ids, second.token_ids) == oracle(lm, messages=chat.messages[:-1], heard=True, **media)
    m = second.metrics
    assert m["kv_reused_tokens"] >= len(first.prompt_ids) and m["prefill_tokens"] < len(second.prompt_ids) // 2
    assert m["megapixels"] == 0 and m["audio_seconds"] == 0  # nothing encoded again


def test_nf4_keeps_both_towers_unquantised_and_matches_generate(load_tiny):
    lm4 = load_tiny(FAMILY, quant="nf4")
    plain = [n for n, _ in linears(lm4.model, torch.nn.Linear)]
    four_bit = [n for n, _ in linears(lm4.model, bnb.nn.Linear4bit)]
    assert any(n.startswith("model.visual.") for n in plain) and any(n.startswith("model.audio_tower.") for n in plain)
    assert all(n.startswith(("model.visual.", "model.audio_tower.")) or n == "lm_head" for n in plain)
    assert four_bit and all(n.startswith("model.language_model.") for n in four_bit)
    result = make_pipe(lm4).run(request(["image", "audio"], [A], [HUM]))
    assert (result.prompt_ids, result.token_ids) == oracle(lm4, ["image", "audio"], [A], [HUM])


# --------------------------------------------------------------------------- media and settings


def test_the_track_is_decoded_with_the_clip(files, clip):
    wave, rate = clip.audio
    assert rate == RATE and torch.allclose(wave, tone(330, 4), atol=1e-4)  # 16-bit PCM
    assert load_video(files["silent"], fps=1).audio is None


def test_hearing_needs_a_track_and_a_model_that_hears(lm, files):
    silent = load_video(files["silent"], fps=1)
    with pytest.raises(UserError, match="silent.mov: the clip has no audio track: media.use_audio_in_video"):
        make_pipe(lm, heard=True).run(request(["video"], videos=[silent]))
    assert make_pipe(lm).run(request(["video"], videos=[silent])).token_ids  # watched only: fine
    other = SimpleNamespace(family=Qwen2VLFamily(), path="tiny-qwen2-vl", processor=None)
    ctx = Context(request=request(["video"], videos=[silent]), lm=other, cache=None, metrics=None)
    with pytest.raises(UserError, match="qwen2-vl model: it cannot hear a video's audio track"):
        Tokenize(use_audio_in_video=True)(ctx)


def test_use_audio_in_video_setting_flows_from_the_config():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        default, on = compose("config"), compose("config", overrides=["media.use_audio_in_video=true"])
        with pytest.raises(ConfigCompositionException):
            compose("config", overrides=["media.use_audio_in_video=maybe"])
        model = compose("config", overrides=["+model=qwen2.5-omni"]).model
    assert stages_from_cfg(default)["tokenize"].use_audio_in_video is False
    assert stages_from_cfg(on)["tokenize"].use_audio_in_video is True
    assert (model.name, model.path) == ("qwen2.5-omni", "Qwen/Qwen2.5-Omni-3B")


@pytest.mark.slow  # the CLI's media path; the pipeline's heard video is checked in-process here
def test_cli_hears_the_video_and_matches_generate(tiny_dir, lm, files, tmp_path):
    proc = run_cli(
        f"model.path={tiny_dir(FAMILY)}",
        f"input=[{files['clip']},{files['png']},{files['wav']}]",
        f"prompt={PROMPT}",
        f"max_new_tokens={N}",
        "ignore_eos=true",
        "media.video_fps=1",
        "media.use_audio_in_video=true",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    video = load_video(files["clip"], fps=1)
    expected = oracle(
        lm,
        ["video", "image", "audio"],
        [load_image(files["png"])],
        [load_audio(files["wav"], RATE)[0]],
        [video],
        heard=True,
    )
    assert (result["prompt_ids"], result["token_ids"]) == expected


@pytest.mark.slow  # a second process end to end (python -m pytest -m slow)
def test_served_and_batched_answers_equal_generate(tiny_dir, lm, files, tmp_path):
    """An image and a sound in one message over the OpenAI API (``mode=serve``), and the same
    request as a line of ``mode=batch``: the thinker's own answer both ways."""
    import base64

    from openai import OpenAI
    from serving import serving

    expected = oracle(lm, ["image", "audio"], [load_image(files["png"])], [load_audio(files["wav"], RATE)[0]])
    want = lm.tokenizer.decode(expected[1], skip_special_tokens=True)
    png = "data:image/png;base64," + base64.b64encode(files["png"].read_bytes()).decode()
    content = [
        {"type": "image_url", "image_url": {"url": png}},
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(files["wav"].read_bytes()).decode(), "format": "wav"},
        },
        {"type": "text", "text": PROMPT},
    ]
    with serving(tmp_path, f"model.path={tiny_dir(FAMILY)}") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(
            model=str(tiny_dir(FAMILY)),
            messages=[{"role": "user", "content": content}],
            max_tokens=N,
            extra_body={"ignore_eos": True},
        )
    assert got.choices[0].message.content == want
    assert got.usage.prompt_tokens == len(expected[0])

    items = tmp_path / "items.jsonl"
    items.write_text(
        json.dumps(
            {
                "id": "a",
                "prompt": PROMPT,
                "images": [str(files["png"])],
                "audios": [str(files["wav"])],
                "max_new_tokens": N,
                "ignore_eos": True,
            }
        )
        + "\n"
    )
    proc = run_cli(
        f"model.path={tiny_dir(FAMILY)}", "mode=batch", f"input={items}", f"hydra.run.dir={tmp_path / 'batch'}"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in next((tmp_path / "batch").glob("*.jsonl")).read_text().splitlines()]
    assert [(r["id"], r["token_ids"]) for r in rows] == [("a", expected[1])]
