"""Qwen2-VL / Qwen2.5-VL: images through the VisionEncoder stage answer exactly like transformers.

Oracle: ``model.generate(do_sample=False)`` on inputs the model's own processor and chat
template build from the same messages, token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from conftest import ROOT, generate_oracle, run_cli
from pipeline import KVCache, Pipeline, Request, UserError, load_model
from pipeline.cli.assemble import processor_kwargs, request_from_cfg
from pipeline.cli.settings import check
from pipeline.media import content_hash, load_image
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

VL = ["qwen2-vl", "qwen2.5-vl"]
N = 10
PROMPT = "What is in the picture?"
CONF = str(ROOT / "conf")


def picture(w: int, h: int, seed: int) -> Image.Image:
    """Random pixels: every image differs from every other even at the same size."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


A = picture(160, 120, 1)
B = picture(160, 120, 2)  # same size as A, other pixels
C = picture(90, 200, 3)  # another size and aspect


def make_pipe(lm) -> Pipeline:
    return Pipeline(
        lm, {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()}
    )


def oracle(lm, images: list[Image.Image], text: str = PROMPT, n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) from the processor's chat template + generate on the same message."""
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]
    inputs = lm.processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    inputs = dict(inputs)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    return ids[0].tolist(), generate_oracle(lm, ids, n, ignore_eos=True, **inputs)


def ask(pipe: Pipeline, images: list[Image.Image], cache: KVCache | None = None, text: str = PROMPT):
    return pipe.run(Request(prompt=text, images=list(images), max_new_tokens=N, ignore_eos=True), cache=cache)


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose("config", overrides=list(overrides))


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family", VL)
@pytest.mark.parametrize("images", [[A], [A, C], []], ids=["one-image", "two-sizes", "text-only"])
def test_matches_generate(load_tiny, family, images):
    lm = load_tiny(family)
    result = ask(make_pipe(lm), images)
    prompt_ids, tokens = oracle(lm, images)
    assert result.prompt_ids == prompt_ids
    assert result.token_ids == tokens
    if images:
        assert result.metrics["image_tokens"] == sum(i == lm.config.image_token_id for i in prompt_ids)
    else:
        assert "vision_encoder" not in result.metrics["stages"] and "image_tokens" not in result.metrics


def test_chunked_prefill_through_images_matches_generate(load_tiny):
    lm = load_tiny("qwen2.5-vl")
    stages = {
        "tokenize": Tokenize(),
        "vision_encoder": VisionEncoder(),
        "prefill": Prefill(chunk_size=16),
        "decode": DecodeLoop(),
    }
    result = ask(Pipeline(lm, stages), [C, A])  # chunk borders fall inside the images
    assert result.token_ids == oracle(lm, [C, A])[1]


@pytest.mark.parametrize("family", VL)
def test_encoder_alone_equals_the_embeddings_the_model_merges(load_tiny, family):
    lm = load_tiny(family)
    pipe = make_pipe(lm)
    ctx = pipe.context(Request(prompt=PROMPT, images=[A, C]))
    with torch.inference_mode():
        pipe.stages["tokenize"](ctx)
        pipe.stages["vision_encoder"](ctx)
    seen: dict = {}

    def grab(module, args, kwargs):
        seen["embeds"] = kwargs["inputs_embeds"].detach().clone()

    hook = lm.model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        inputs = {k: v for k, v in ctx.model_inputs.items() if isinstance(v, torch.Tensor)}
        with torch.inference_mode():
            lm.model(input_ids=ctx.input_ids, **inputs)
    finally:
        hook.remove()
    assert torch.equal(ctx.inputs_embeds, seen["embeds"])


def test_rope_deltas_live_in_the_cache_not_the_model(load_tiny):
    lm = load_tiny("qwen2-vl")
    pipe = make_pipe(lm)
    image_cache, text_cache = pipe.new_cache(), pipe.new_cache()
    ask(pipe, [A], cache=image_cache)
    ask(pipe, [], cache=text_cache)
    ctx = pipe.tokenize(Request(prompt=PROMPT, images=[A]))
    _, deltas = lm.model.model.get_rope_index(
        ctx.input_ids, ctx.model_inputs["mm_token_type_ids"], image_grid_thw=ctx.model_inputs["image_grid_thw"]
    )
    assert image_cache.state["rope_deltas"] == int(deltas) != 0
    assert text_cache.state["rope_deltas"] == 0
    # Continuing the image conversation after the text one still decodes from its own delta.
    assert ask(pipe, [A], cache=image_cache).token_ids == oracle(lm, [A])[1]


# --------------------------------------------------------------------------- KV reuse


def test_same_size_other_image_is_never_reused(load_tiny):
    lm = load_tiny("qwen2-vl")
    pipe = make_pipe(lm)
    cache = pipe.new_cache()
    first = ask(pipe, [A], cache=cache)
    second = ask(pipe, [B], cache=cache)
    assert first.prompt_ids == second.prompt_ids  # same ids: only the content hash tells them apart
    first_image_pos = first.prompt_ids.index(lm.config.image_token_id)
    assert second.metrics["kv_reused_tokens"] == first_image_pos
    assert second.metrics["megapixels"] > 0
    assert second.token_ids == ask(pipe, [B]).token_ids == oracle(lm, [B])[1]


def test_same_image_again_skips_the_encoder_and_equals_fresh(load_tiny):
    lm = load_tiny("qwen2.5-vl")
    pipe = make_pipe(lm)
    cache = pipe.new_cache()
    ask(pipe, [A], cache=cache)
    again = ask(pipe, [A], cache=cache, text="And the colours?")
    last_image_pos = len(again.prompt_ids) - 1 - again.prompt_ids[::-1].index(lm.config.image_token_id)
    assert again.metrics["kv_reused_tokens"] > last_image_pos
    assert again.metrics["megapixels"] == 0 and again.metrics["image_tokens"] > 0
    assert again.token_ids == oracle(lm, [A], text="And the colours?")[1]


def test_follow_up_with_a_new_image_encodes_only_the_new_one(load_tiny):
    lm = load_tiny("qwen2-vl")
    pipe = make_pipe(lm)
    cache = pipe.new_cache()
    turn1 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    first = pipe.run(Request(messages=turn1, images=[A], max_new_tokens=N, ignore_eos=True), cache=cache)
    turn2 = turn1 + [
        {"role": "assistant", "content": [{"type": "text", "text": first.text}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    follow = Request(messages=turn2, images=[A, C], max_new_tokens=N, ignore_eos=True)
    reused = pipe.run(follow, cache=cache)
    fresh_pipe = Pipeline(lm, pipe.stages, kv_memory=7 << 20)  # a pool of its own: nothing cached
    fresh = fresh_pipe.run(follow)
    assert reused.token_ids == fresh.token_ids
    assert reused.metrics["kv_reused_tokens"] > first.prompt_ids.index(lm.config.image_token_id)
    assert 0 < reused.metrics["megapixels"] < fresh.metrics["megapixels"]


def test_cache_keys_carry_the_image_content(load_tiny):
    lm = load_tiny("qwen2-vl")
    pipe = make_pipe(lm)
    ka = pipe.tokenize(Request(prompt=PROMPT, images=[A])).token_keys
    kb = pipe.tokenize(Request(prompt=PROMPT, images=[B])).token_keys
    image_keys = [k for k in ka if isinstance(k, tuple)]
    assert image_keys and image_keys[0] == (lm.config.image_token_id, content_hash(A), 0)
    assert [k for k in ka if not isinstance(k, tuple)] == [k for k in kb if not isinstance(k, tuple)]
    assert not set(image_keys) & {k for k in kb if isinstance(k, tuple)}


# --------------------------------------------------------------------------- settings


@pytest.mark.filterwarnings("ignore:Passing `min_pixels`:FutureWarning")  # the oracle's processor call
def test_processor_pixel_bounds_change_the_image_tokens(tiny_dir):
    small = load_model(str(tiny_dir("qwen2-vl")), processor_kwargs={"max_pixels": 56 * 56})
    large = load_model(str(tiny_dir("qwen2-vl")), processor_kwargs={"min_pixels": 28 * 28 * 100})
    n_small = ask(make_pipe(small), [A]).metrics["image_tokens"]
    result = ask(make_pipe(large), [A])
    assert n_small * 28 * 28 <= 56 * 56  # each merged token covers 28x28 px of the resized image
    assert result.metrics["image_tokens"] >= 100
    assert result.token_ids == oracle(large, [A])[1]


def test_processor_settings_from_config():
    assert processor_kwargs(cfg()) is None  # nulls mean: the model's own preprocessor config
    assert processor_kwargs(cfg("model.processor.max_pixels=50000")) == {"max_pixels": 50000}
    with pytest.raises(UserError, match="min_pixels .* above max_pixels"):
        check(cfg("model.processor.min_pixels=9000", "model.processor.max_pixels=100"))
    with pytest.raises(UserError, match="model.processor.max_pixels"):
        check(cfg("model.processor.max_pixels=0"))


def test_image_without_prompt_gets_the_default_question(load_tiny):
    lm = load_tiny("qwen2-vl")
    shapes = ROOT / "examples" / "shapes.png"
    request = request_from_cfg(cfg(f"input={shapes}", f"max_new_tokens={N}", "ignore_eos=true"))
    assert request.prompt is None and len(request.images) == 1
    result = make_pipe(lm).run(request)
    prompt_ids, tokens = oracle(lm, request.images, text="Describe this image.")
    assert (result.prompt_ids, result.token_ids) == (prompt_ids, tokens)


def test_several_inputs_keep_their_order_and_exif_orientation():
    a, b = ROOT / "examples" / "shapes.png", ROOT / "examples" / "photo.jpg"  # photo.jpg: EXIF rotated
    request = request_from_cfg(cfg(f"input=[{b},{a}]"))
    assert [content_hash(im) for im in request.images] == [content_hash(load_image(b)), content_hash(load_image(a))]
    assert request.images[0].size == Image.open(b).size[::-1]


# --------------------------------------------------------------------------- bad input


def bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, a word the one-line error must contain)."""
    jpeg = tmp / "cut.jpg"
    A.save(jpeg, "JPEG")
    jpeg.write_bytes(jpeg.read_bytes()[: jpeg.stat().st_size // 2])
    (tmp / "empty.png").write_bytes(b"")
    (tmp / "notes.png").write_text("just some text, not an image\n" * 10)
    (tmp / "folder.jpg").mkdir()
    return {
        "missing": (tmp / "nope.jpg", "not found"),
        "directory": (tmp / "folder.jpg", "directory"),
        "not-an-image": (tmp / "notes.png", "neither an image"),
        "truncated": (jpeg, "truncated"),
        "zero-bytes": (tmp / "empty.png", "empty"),
    }


@pytest.mark.parametrize("case", ["missing", "directory", "not-an-image", "truncated", "zero-bytes"])
def test_bad_image_file_is_one_line_naming_it(tmp_path, case):
    path, word = bad_files(tmp_path)[case]
    with pytest.raises(UserError) as err:
        request_from_cfg(cfg(f"input=[{ROOT / 'examples' / 'shapes.png'},{path}]"))
    message = str(err.value)
    assert path.name in message and word in message and "\n" not in message


def test_pixel_limit_is_configurable(tmp_path):
    photo = ROOT / "examples" / "photo.jpg"  # 320x240 = 76,800 pixels
    assert len(request_from_cfg(cfg(f"input={photo}", "media.max_image_pixels=76800")).images) == 1
    with pytest.raises(UserError) as err:
        request_from_cfg(cfg(f"input={photo}", "media.max_image_pixels=76799"))
    assert "photo.jpg" in str(err.value) and "76,800" in str(err.value)
    with pytest.raises(UserError, match="media.max_image_pixels"):
        check(cfg(f"input={photo}", "media.max_image_pixels=-1"))


def test_image_to_a_text_model_names_the_file(load_tiny):
    lm = load_tiny("qwen3")
    request = request_from_cfg(cfg(f"input={ROOT / 'examples' / 'shapes.png'}"))
    with pytest.raises(UserError, match=r"shapes\.png: .* without an image encoder"):
        Pipeline(lm, {"tokenize": Tokenize(), "vision_encoder": VisionEncoder()}).run(request)


def test_image_the_processor_refuses_is_one_line_naming_it(load_tiny):
    thin = picture(600, 2, 4)  # aspect ratio 300:1, beyond what Qwen2-VL's resizing accepts
    thin.info["source"] = "thin.png"
    with pytest.raises(UserError) as err:
        make_pipe(load_tiny("qwen2-vl")).run(Request(prompt=PROMPT, images=[thin]))
    assert "thin.png (600x2)" in str(err.value) and "\n" not in str(err.value)


def test_images_and_placeholders_must_agree(load_tiny):
    lm = load_tiny("qwen2-vl")
    two_slots = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(UserError, match="2 image placeholder"):
        make_pipe(lm).run(Request(messages=two_slots, images=[A]))


# --------------------------------------------------------------------------- command line


def test_cli_two_images_matches_generate_and_reports_vision_metrics(tiny_dir, load_tiny, tmp_path):
    a, b = ROOT / "examples" / "shapes.png", ROOT / "examples" / "photo.jpg"
    proc = run_cli(
        f"model.path={tiny_dir('qwen2-vl')}",
        f"input=[{a},{b}]",
        f"max_new_tokens={N}",
        "ignore_eos=true",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    lm = load_tiny("qwen2-vl")
    images = [load_image(a), load_image(b)]  # upright, as the CLI loads them
    prompt_ids, tokens = oracle(lm, images, text="Describe this image.")
    assert (result["prompt_ids"], result["token_ids"]) == (prompt_ids, tokens)
    m = result["metrics"]
    assert m["image_tokens"] == prompt_ids.count(lm.config.image_token_id)
    assert m["megapixels"] > 0 and m["vision_mp_s"] > 0 and m["stages"]["vision_encoder"]["seconds"] > 0


@pytest.mark.slow  # suite time; test_stage_hooks' image-without-encoder CLI line covers the path
def test_cli_image_to_a_text_model_is_one_line_and_exit_2(tiny_dir, tmp_path):
    path = ROOT / "examples" / "shapes.png"
    proc = run_cli(f"model.path={tiny_dir('qwen3')}", f"input={path}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and path.name in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
