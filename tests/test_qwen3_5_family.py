"""Qwen3.5's model knowledge, checked without the KV cache: the tiny builders make both layer
kinds, both tiny models generate, and what the family hands the decoder (prompt ids, merged
image and video embeddings, 4-row M-RoPE positions, decode positions) is what the model's own
processor, ``get_rope_index``, ``compute_3d_position_ids`` and forward use.

A context here holds a stand-in cache (``state`` and an empty ``common_prefix``): only the
tokenize and vision stages run, no paged pool is made.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

from conftest import generate_oracle
from pipeline.context import Context, Request
from pipeline.families import family_for_config
from pipeline.media import Video
from pipeline.memory import layer_kinds
from pipeline.metrics import Metrics
from stages import Tokenize, VisionEncoder

VL, TEXT = "qwen3.5", "qwen3.5-text"
PROMPT = "What is in the picture?"
N = 8


def picture(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


A, C = picture(160, 120, 1), picture(90, 200, 3)


def clip(frames: int = 6, seed: int = 5) -> Video:
    rng = np.random.default_rng(seed)
    return Video.from_frames(rng.integers(0, 256, (frames, 64, 96, 3), dtype=np.uint8), fps=2.0)


def context(lm, request: Request, vision: bool = True) -> Context:
    """Tokenize (and encode the media of) ``request`` with a stand-in cache that holds nothing."""
    cache = SimpleNamespace(state={}, common_prefix=lambda keys: 0)
    ctx = Context(request=request, lm=lm, cache=cache, metrics=Metrics(lm.device))
    with torch.inference_mode():
        Tokenize()(ctx)
        if vision and (request.images or request.videos):
            VisionEncoder()(ctx)
    return ctx


def reference(lm, request: Request) -> dict:
    """The processor's own inputs for the same message (chat template, then images and clips)."""
    kinds = request.media_order or ["image"] * len(request.images) + ["video"] * len(request.videos)
    content = [{"type": k} for k in kinds] + [{"type": "text", "text": request.prompt}]
    extra = {} if request.thinking is None else {"enable_thinking": request.thinking}
    prompt = lm.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False, **extra
    )
    media = {"images": list(request.images) or None}
    if request.videos:
        media.update(
            videos=[v.frames for v in request.videos],
            video_metadata=[v.metadata() for v in request.videos],
            do_sample_frames=False,
        )
    out = dict(lm.processor(text=[prompt], return_tensors="pt", **media))
    out.pop("attention_mask")
    return out


# --------------------------------------------------------------------------- the tiny builders


def own_forward(lm, ids: torch.Tensor, ref: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own forward on the processor's inputs: its logits, and the embeddings it
    handed its decoder (caught on the way in)."""
    seen: dict = {}
    hook = lm.model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"].detach().clone()), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            logits = lm.model(input_ids=ids, **ref).logits
    finally:
        hook.remove()
    return logits, seen["embeds"]


def test_tiny_builders_make_both_layer_kinds(tiny_dir):
    vl, text = (tf.AutoConfig.from_pretrained(tiny_dir(f)) for f in (VL, TEXT))
    assert (vl.model_type, vl.architectures, text.model_type, text.architectures) == (
        "qwen3_5",
        ["Qwen3_5ForConditionalGeneration"],
        "qwen3_5_text",
        ["Qwen3_5ForCausalLM"],
    )
    kinds = layer_kinds(vl)
    assert kinds == layer_kinds(text) == ["linear_attention", "full_attention"] * 2
    # the text-only model is the VL model's decoder, setting for setting
    skip = {"model_type", "architectures", "dtype", "transformers_version", "_name_or_path"}
    same = {k: v for k, v in vl.text_config.to_dict().items() if k not in skip}
    assert same == {k: v for k, v in text.to_dict().items() if k in same}
    rope = vl.text_config.rope_parameters
    assert rope["mrope_interleaved"] and sum(rope["mrope_section"]) * 2 == vl.text_config.head_dim * 0.25
    assert not hasattr(vl.vision_config, "deepstack_visual_indexes")


def test_tiny_models_hold_both_layer_kinds_and_their_families(load_tiny):
    vl, text = load_tiny(VL), load_tiny(TEXT)
    assert (vl.family.name, vl.family.auto_class, vl.family.media) == (
        VL,
        "Qwen3_5ForConditionalGeneration",
        ("image", "video"),
    )
    assert (text.family.name, text.processor, text.family.media) == (TEXT, None, ())
    assert family_for_config(vl.config).name == VL and family_for_config(text.config).name == TEXT
    assert isinstance(vl.model, tf.Qwen3_5ForConditionalGeneration) and isinstance(text.model, tf.Qwen3_5ForCausalLM)
    for lm, layers in ((vl, vl.model.model.language_model.layers), (text, text.model.model.layers)):
        assert [("linear" if hasattr(layer, "linear_attn") else "full") for layer in layers] == ["linear", "full"] * 2
    assert type(vl.processor).__name__ == "Qwen3VLProcessor"
    assert type(vl.processor.video_processor).__name__ == "Qwen3VLVideoProcessor"


# --------------------------------------------------------------------------- the multimodal model


@pytest.mark.parametrize("images", [[A], [A, C]], ids=["one-image", "two-images"])
def test_images_placeholders_embeddings_and_positions_are_the_models(load_tiny, images):
    lm = load_tiny(VL)
    request = Request(prompt=PROMPT, images=images)
    ctx = context(lm, request)
    ref = reference(lm, request)
    ids = ref.pop("input_ids")
    assert torch.equal(ctx.input_ids, ids)
    # one placeholder per merged 2 x 2 patch of each image, in one run per image
    grid = ref["image_grid_thw"]
    spans = lm.family.image_spans(ctx)
    assert [end - start for start, end in spans] == (grid.prod(-1) // 4).tolist()
    assert int((ids == lm.config.image_token_id).sum()) == int(grid.prod(-1).sum()) // 4 > 0
    assert ctx.metrics.counters["image_tokens"] == int(grid.prod(-1).sum()) // 4
    # the embeddings the family merged are the ones the model's own forward hands its decoder
    own, embeds = own_forward(lm, ids, ref)
    assert torch.equal(ctx.inputs_embeds, embeds)
    # positions: the text row, then get_rope_index's three rows (interleaved M-RoPE)
    positions = lm.family.prompt_positions(ctx, 0)
    rope, deltas = lm.model.model.get_rope_index(ids, mm_token_type_ids=ref["mm_token_type_ids"], image_grid_thw=grid)
    assert torch.equal(positions[0, 0], torch.arange(ids.shape[1]))
    assert torch.equal(positions[1:], rope) and ctx.cache.state["rope_deltas"] == int(deltas) < 0
    assert torch.equal(lm.family.prompt_positions(ctx, 5), positions[..., 5:])
    # ... which are what the model's own compute_3d_position_ids makes for the prompt and the next token
    model = lm.model.model
    try:
        with torch.inference_mode():
            prompt_rows = model.compute_3d_position_ids(
                ids, ctx.inputs_embeds, image_grid_thw=grid, mm_token_type_ids=ref["mm_token_type_ids"]
            )
            past = SimpleNamespace(get_seq_length=lambda: ids.shape[1])
            next_rows = model.compute_3d_position_ids(None, ctx.inputs_embeds[:, :1], past_key_values=past)
    finally:
        model.rope_deltas = None
    assert torch.equal(positions[1:], prompt_rows)
    decode = lm.family.decode_positions(ctx, ids.shape[1])
    assert decode[0].item() == ids.shape[1] and torch.equal(decode[1:], next_rows)
    # the family's prefill inputs (merged embeddings, explicit positions) give the model's own logits
    with torch.inference_mode():
        mine = lm.model(inputs_embeds=ctx.inputs_embeds, position_ids=positions).logits
    assert torch.allclose(mine, own, atol=1e-5)
    tokens = generate_oracle(lm, ids, N, ignore_eos=True, **ref)
    assert len(tokens) == N and len(set(tokens)) > 1 and tokens[0] == int(own[0, -1].argmax())
    assert lm.family.chunk_extras(ctx, 0, ids.shape[1]) is None  # no deepstack rows to carry


@pytest.mark.parametrize("kinds", [["video"], ["image", "video"]], ids=["video", "image-then-video"])
def test_video_spans_and_positions_are_the_models(load_tiny, kinds):
    """A clip is one placeholder run per temporal patch after its timestamp; get_rope_index splits
    it the same way, and the merged span keeps the timestamp text's own embeddings."""
    lm = load_tiny(VL)
    video = clip()
    request = Request(prompt=PROMPT, images=[A] if "image" in kinds else [], videos=[video], media_order=kinds)
    ctx = context(lm, request)
    ref = reference(lm, request)
    ids = ref.pop("input_ids")
    assert torch.equal(ctx.input_ids, ids)
    grid = ref["video_grid_thw"]
    assert grid[0, 0] == 3  # 6 frames, two per temporal patch
    ((start, end),) = lm.family.video_spans(ctx)
    pads = ids[0, start:end] == lm.config.video_token_id
    assert int(pads.sum()) == int(grid.prod()) // 4 == ctx.metrics.counters["video_tokens"]
    runs = int((pads[1:] & ~pads[:-1]).sum()) + 1
    assert runs == 3  # one run per temporal patch, timestamp text between them
    own, embeds = own_forward(lm, ids, ref)
    assert torch.equal(ctx.inputs_embeds, embeds)
    positions = lm.family.prompt_positions(ctx, 0)
    grids = {k: ref[k] for k in ("image_grid_thw", "video_grid_thw") if k in ref}
    rope, deltas = lm.model.model.get_rope_index(ids, mm_token_type_ids=ref["mm_token_type_ids"], **grids)
    assert torch.equal(positions[1:], rope) and ctx.cache.state["rope_deltas"] == int(deltas)
    with torch.inference_mode():
        mine = lm.model(inputs_embeds=ctx.inputs_embeds, position_ids=positions).logits
    assert torch.allclose(mine, own, atol=1e-5)
    tokens = generate_oracle(lm, ids, N, ignore_eos=True, **ref)
    assert len(tokens) == N and tokens[0] == int(own[0, -1].argmax())


def test_the_template_thinks_only_when_asked(load_tiny):
    """The published Qwen3.5-0.8B template: an empty think block unless thinking=true."""
    lm = load_tiny(VL)
    text = {
        t: context(lm, Request(prompt="Why?", thinking=t), vision=False).extras["prompt_text"]
        for t in (None, False, True)
    }
    head = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    assert text[None] == text[False] == head + "<think>\n\n</think>\n\n"
    assert text[True] == head + "<think>\n"


# --------------------------------------------------------------------------- the text-only model


def test_text_only_model_generates_from_the_familys_inputs(load_tiny):
    lm = load_tiny(TEXT)
    ctx = context(lm, Request(prompt=PROMPT))
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert torch.equal(ctx.input_ids, ids)
    assert ctx.extras["prompt_text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    positions = lm.family.prompt_positions(ctx, 0)
    assert torch.equal(positions, torch.arange(ids.shape[1]).view(1, -1))
    with torch.inference_mode():
        own = lm.model(input_ids=ids).logits
        mine = lm.model(input_ids=ids, position_ids=positions).logits
    assert torch.equal(mine, own)
    tokens = generate_oracle(lm, ids, N, ignore_eos=True)
    assert len(tokens) == N and len(set(tokens)) > 1 and tokens[0] == int(own[0, -1].argmax())
    assert all(t < len(lm.tokenizer) for t in tokens)
