"""Video for Qwen2-VL / Qwen2.5-VL: clips decoded with PyAV and sampled in time answer exactly like
transformers, alone or mixed with images in the order given; the sampling settings, metrics, bad
files, chat ``/video`` and batch ``"videos"`` (serve ``video_url``: tests/test_serve.py).

Oracle: transformers' own ``load_video`` (PyAV backend, its own frame sampling) and the model's
processor, then ``model.generate(do_sample=False)``, token for token. The clips are drawn with
PIL and written with PyAV at 8 fps, so both samplings pick the same frames.
"""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from PIL import Image, ImageDraw

from conftest import ROOT, generate_oracle, run_cli
from pipeline import Pipeline, Request, UserError
from pipeline.cli.assemble import request_from_cfg
from pipeline.cli.settings import check
from pipeline.frontends.chat_session import ChatSession
from pipeline.media import Video, content_hash, load_image, load_video, media_kind
from pipeline.modes import batch, processes, run
from pipeline.modes.chat import Repl
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

N = 8
PROMPT = "What happens in the clip?"
CONF = str(ROOT / "conf")


# --------------------------------------------------------------------------- clips


def drawn(n: int, w: int = 64, h: int = 48, seed: int = 0) -> list[Image.Image]:
    """Frames of a red box moving right and a cyan disc moving left, over noise (no two alike)."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        im = Image.fromarray(rng.integers(0, 60, (h, w, 3), dtype=np.uint8), "RGB")
        d = ImageDraw.Draw(im)
        d.rectangle([3 * i, 8, 3 * i + 14, 22], fill=(240, 20, 20))
        d.ellipse([w - 18 - 2 * i, 24, w - 4 - 2 * i, 38], fill=(20, 210, 240))
        frames.append(im)
    return frames


def write_clip(path: Path, frames: list[Image.Image], fps: int, codec: str, fmt: str | None = None) -> Path:
    with av.open(str(path), "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for im in frames:
            out.mux(stream.encode(av.VideoFrame.from_image(im)))
        out.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("clips")
    h264 = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    out = {
        "mp4": write_clip(tmp / "clip.mp4", drawn(16), 8, h264),  # 2.0 s at 8 fps
        "other": write_clip(tmp / "other.mp4", drawn(16, seed=1), 8, h264),
        "webm": write_clip(tmp / "clip.webm", drawn(10), 4, "libvpx-vp9"),  # 2.5 s at 4 fps
        "mov": write_clip(tmp / "clip.mov", drawn(6), 4, "mpeg4", "mov"),
    }
    gif = drawn(4)  # frames on screen 0.5, 0.1, 0.1 and 0.3 s: sampling must follow time, not index
    gif[0].save(tmp / "anim.gif", save_all=True, append_images=gif[1:], duration=[500, 100, 100, 300], loop=0)
    gif[0].save(tmp / "still.gif")
    out["gif"], out["still_gif"] = tmp / "anim.gif", tmp / "still.gif"
    data = out["mp4"].read_bytes()
    (tmp / "cut.mp4").write_bytes(data[: len(data) // 2])  # the index (moov) is lost with the tail
    out["cut"] = tmp / "cut.mp4"
    with av.open(str(tmp / "empty.mp4"), "w") as empty:  # a valid MP4 holding no frame at all
        stream = empty.add_stream(h264, rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        empty.start_encoding()
    out["empty"] = tmp / "empty.mp4"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(tmp / "a.png")
    Image.fromarray(np.random.default_rng(6).integers(0, 256, (50, 30, 3), dtype=np.uint8)).save(tmp / "b.png")
    out["a"], out["b"] = tmp / "a.png", tmp / "b.png"
    return out


# --------------------------------------------------------------------------- helpers


def make_pipe(lm) -> Pipeline:
    return Pipeline(
        lm, {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()}
    )


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=list(overrides))


def oracle(lm, kinds: list[str], images: list, clips: list[Path], fps: float, text: str = PROMPT, n: int = N):
    """(prompt ids, greedy tokens): transformers decodes and samples the clips itself."""
    from transformers.video_utils import load_video as hf_load_video

    decoded = [hf_load_video(str(c), backend="pyav", fps=fps) for c in clips]
    content = [{"type": kind} for kind in kinds] + [{"type": "text", "text": text}]
    prompt = lm.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = dict(
        lm.processor(
            text=[prompt],
            images=images or None,
            videos=[f for f, _ in decoded],
            video_metadata=[m for _, m in decoded],
            do_sample_frames=False,
            return_tensors="pt",
        )
    )
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    return ids[0].tolist(), generate_oracle(lm, ids, n, ignore_eos=True, **inputs)


def one_error_line(proc, name: str, word: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and name in errors[0] and word in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_clip_matches_generate(load_tiny, clips, family):
    # 4 frames/s of an 8 fps clip: Qwen2.5-VL's temporal positions then step by 1, not the
    # 2 that a missing second_per_grid_ts would give, so a lost timing changes the tokens.
    lm = load_tiny(family)
    video = load_video(clips["mp4"], fps=4)
    result = make_pipe(lm).run(Request(prompt=PROMPT, videos=[video], max_new_tokens=N, ignore_eos=True))
    prompt_ids, tokens = oracle(lm, ["video"], [], [clips["mp4"]], fps=4)
    assert (result.prompt_ids, result.token_ids) == (prompt_ids, tokens)
    m = result.metrics
    assert m["video_tokens"] == prompt_ids.count(lm.config.video_token_id) > 0
    assert (m["video_frames"], m["video_seconds"]) == (8, pytest.approx(2.0))
    # 8 frames resized to 56x56 (the tiny processor's minimum), all seen by the encoder
    assert m["megapixels"] == pytest.approx(8 * 56 * 56 / 1e6) and m["vision_mp_s"] > 0
    assert "image_tokens" not in m


def test_image_video_text_in_the_order_given(load_tiny, clips):
    lm = load_tiny("qwen2.5-vl")
    request = request_from_cfg(
        cfg(
            f"input=[{clips['a']},{clips['mp4']},{clips['b']}]",
            f"prompt={PROMPT}",
            f"max_new_tokens={N}",
            "ignore_eos=true",
        )
    )
    assert request.media_order == ["image", "video", "image"]
    result = make_pipe(lm).run(request)
    images = [load_image(clips["a"]), load_image(clips["b"])]
    prompt_ids, tokens = oracle(lm, ["image", "video", "image"], images, [clips["mp4"]], fps=2)
    assert (result.prompt_ids, result.token_ids) == (prompt_ids, tokens)
    ids, image, video = result.prompt_ids, lm.config.image_token_id, lm.config.video_token_id
    assert ids.index(image) < ids.index(video) < len(ids) - 1 - ids[::-1].index(image)
    assert result.metrics["video_frames"] == 4 and result.metrics["image_tokens"] > 0
    assert result.metrics["megapixels"] > 4 * 56 * 56 / 1e6  # the two images count too


def test_cache_keys_carry_the_clip_content_and_timing(load_tiny, clips):
    lm = load_tiny("qwen2-vl")
    pipe = make_pipe(lm)

    def video_keys(video: Video) -> set:
        keys = pipe.tokenize(Request(prompt=PROMPT, videos=[video])).token_keys
        return {k for k in keys if isinstance(k, tuple)}

    a, b = load_video(clips["mp4"]), load_video(clips["other"])  # same size and timing, other pixels
    assert (lm.config.video_token_id, content_hash(a), 0) in video_keys(a)
    assert not video_keys(a) & video_keys(b)
    same_frames_slower = Video(a.frames, a.indices, [2 * t for t in a.timestamps], a.total_frames, 2 * a.duration)
    assert content_hash(same_frames_slower) != content_hash(a) == content_hash(load_video(clips["mp4"]))


# --------------------------------------------------------------------------- settings


def test_fps_and_max_frames_set_the_frame_count(load_tiny, clips):
    def sampled(*overrides: str) -> Video:
        return request_from_cfg(cfg(f"input={clips['mp4']}", *overrides)).videos[0]

    assert sampled().indices == [0, 4, 8, 12]  # default 2 frames per second of a 2 s clip
    assert sampled("media.video_fps=1").indices == [0, 8]
    assert sampled("media.video_fps=4").num_frames == 8
    assert sampled("media.video_fps=100").num_frames == 16  # never more frames than the clip has
    capped = sampled("media.video_fps=4", "media.video_max_frames=3")
    assert capped.indices == [0, 5, 10] and capped.duration == pytest.approx(2.0)  # sparser, never cut
    pipe = make_pipe(load_tiny("qwen2-vl"))
    for overrides, frames in ((["media.video_fps=1"], 2), (["media.video_max_frames=3", "media.video_fps=4"], 3)):
        request = request_from_cfg(cfg(f"input={clips['mp4']}", "max_new_tokens=1", *overrides))
        assert pipe.run(request).metrics["video_frames"] == frames
    for bad, name in (("media.video_fps=0", "media.video_fps"), ("media.video_max_frames=0", "media.video_max_frames")):
        with pytest.raises(UserError, match=name):
            check(cfg(f"input={clips['mp4']}", bad))


# --------------------------------------------------------------------------- formats


def test_gif_webm_and_mov_decode(clips):
    assert media_kind(clips["gif"]) == "video" and media_kind(clips["still_gif"]) == "image"
    gif = load_video(clips["gif"], fps=4)  # 1.0 s: targets 0, .25, .5, .75 s
    assert gif.indices == [0, 0, 1, 3] and gif.timestamps == pytest.approx([0.0, 0.0, 0.5, 0.7])
    assert gif.duration == pytest.approx(1.0) and gif.size == (64, 48)
    webm = load_video(clips["webm"])
    assert media_kind(clips["webm"]) == "video" and webm.indices == [0, 2, 4, 6, 8]
    assert webm.metadata()["fps"] == pytest.approx(4.0)
    mov = load_video(clips["mov"], fps=4)
    assert media_kind(clips["mov"]) == "video" and mov.indices == list(range(6))
    red_box = mov.frames[0][8:22, 0:14].reshape(-1, 3).mean(0)  # frame 0's box, after a lossy codec
    assert red_box[0] > 150 and red_box[1] < 90


def test_bad_video_files_are_one_line(clips):
    for name, word in (("cut", "corrupt"), ("empty", "no video frames")):
        with pytest.raises(UserError) as err:
            load_video(clips[name])
        assert clips[name].name in str(err.value) and word in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow  # suite time: two interpreters; the same errors in-process above
def test_bad_video_files_on_the_cli_are_one_line_and_exit_2(clips, tmp_path):
    runs = [(clips[name], (f"input={clips[name]}", f"hydra.run.dir={tmp_path / name}")) for name in ("cut", "empty")]
    with ThreadPoolExecutor(2) as pool:  # two interpreters start at once: half the wall time
        procs = list(pool.map(lambda r: run_cli(*r[1]), runs))
    one_error_line(procs[0], "cut.mp4", "corrupt or unreadable video")
    one_error_line(procs[1], "empty.mp4", "zero decodable frames")


def test_mode_run_reports_the_video_metrics(tiny_dir, clips, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run, "run_dir", lambda: tmp_path)
    run.main(cfg(f"model.path={tiny_dir('qwen2-vl')}", f"input={clips['webm']}", "max_new_tokens=2", "stream=false"))
    metrics = json.loads((tmp_path / "result.json").read_text())["metrics"]
    assert metrics["video_frames"] == 5 and metrics["video_seconds"] == pytest.approx(2.5)
    table = capsys.readouterr().err
    assert all(key in table for key in ("video_frames", "video_seconds", "video_tokens", "megapixels"))


# --------------------------------------------------------------------------- chat and batch


def test_chat_video_command_and_a_second_turn_from_the_cache(load_tiny, clips):
    lm = load_tiny("qwen2-vl")
    pipe = make_pipe(lm)
    chat = ChatSession(pipe, max_new_tokens=N)
    err = io.StringIO()
    script = f"/video {clips['mp4']}\n{PROMPT}\nAnd then?\n"
    Repl(chat, stdin=io.StringIO(script), stdout=io.StringIO(), stderr=err, stream=False).loop()
    assert "(4 frames over 2.0 s) attached" in err.getvalue()
    first, second = (turn.result for turn in chat.turns)
    fresh = pipe.run(Request(prompt=PROMPT, videos=[load_video(clips["mp4"])], max_new_tokens=N))
    assert first.token_ids == fresh.token_ids and first.metrics["video_frames"] == 4
    pad = lm.config.video_token_id
    last_pad = len(second.prompt_ids) - 1 - second.prompt_ids[::-1].index(pad)
    assert second.metrics["kv_reused_tokens"] > last_pad  # the clip came from the cache ...
    assert second.metrics["video_frames"] == 0 and second.metrics["megapixels"] == 0  # ... not re-encoded
    again = pipe.run(Request(messages=chat.messages[:-1], videos=chat.turns[0].videos, max_new_tokens=N))
    assert second.token_ids == again.token_ids


def test_batch_jsonl_videos(tiny_dir, load_tiny, clips, tmp_path, monkeypatch):
    p = tmp_path / "p.jsonl"
    rows = [
        {"id": "v", "prompt": PROMPT, "videos": [str(clips["mp4"])], "max_new_tokens": N},
        {"id": "bad", "prompt": PROMPT, "videos": [str(clips["a"])]},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    monkeypatch.setattr(processes, "run_dir", lambda: tmp_path)
    with pytest.raises(UserError, match="1 of 2 items failed"):  # a picture under "videos" fails alone
        batch.main(cfg("mode=batch", "batch.progress=false", f"input={p}", f"model.path={tiny_dir('qwen2-vl')}"))
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    expected = make_pipe(load_tiny("qwen2-vl")).run(
        Request(prompt=PROMPT, videos=[load_video(clips["mp4"])], max_new_tokens=N)
    )
    assert records["v"]["token_ids"] == expected.token_ids and records["v"]["metrics"]["video_frames"] == 4
    assert "not a video file" in records["bad"]["error"]
