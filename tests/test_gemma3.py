"""Gemma 3: image blocks attended both ways, sliding-window layers on the paged pool, exact
against transformers.

Oracle: ``model.generate(do_sample=False)`` on what the model's own processor and chat template
build from the same messages (``token_type_ids`` included, so transformers builds its
bidirectional image masks), token for token; where a test says so, also the prefill logits
against one full forward of the model. The tiny model's window is 8 tokens and an image is 16
soft tokens, so every prompt crosses the window and the window cuts through image blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

import pipeline.runner.model_runner as engine_module
from conftest import ROOT, generate_oracle
from pipeline import Pipeline, Request, load_model
from pipeline.frontends.chat_session import ChatSession
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

N = 10
PROMPT = "What is in the picture?"
LONG = (
    "The river flows through the valley between the mountains, and the trees on the hills are green. "
    "She opened the window, looked at the garden, and saw the flowers."
)


def picture(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


A, B, C = picture(160, 120, 1), picture(90, 200, 2), picture(64, 64, 3)


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("gemma3")


def make_pipe(lm, chunk_size: int | None = None, **engine) -> Pipeline:
    stages = {
        "tokenize": Tokenize(),
        "vision_encoder": VisionEncoder(),
        "prefill": Prefill(chunk_size=chunk_size),
        "decode": DecodeLoop(),
    }
    return Pipeline(lm, stages, **engine)


def user(images: list, text: str) -> dict:
    items = [{"type": "image", "image": im} for im in images]
    return {"role": "user", "content": items + [{"type": "text", "text": text}]}


def oracle_inputs(lm, messages: list[dict]) -> dict:
    """The processor's own inputs for ``messages`` (ids, pixels, token_type_ids)."""
    inputs = lm.processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    inputs = dict(inputs)
    inputs.pop("attention_mask")
    return inputs


def oracle(lm, messages: list[dict], n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy generate tokens) for ``messages``."""
    inputs = oracle_inputs(lm, messages)
    ids = inputs.pop("input_ids")
    return ids[0].tolist(), generate_oracle(lm, ids, n, ignore_eos=True, **inputs)


def ask(pipe: Pipeline, images: list, text: str = PROMPT, n: int = N):
    return pipe.run(Request(prompt=text, images=list(images), max_new_tokens=n, ignore_eos=True))


def prefilled(pipe: Pipeline, images: list, text: str = PROMPT):
    """The context after our prefill (stages driven by hand, a new cache): ``ctx.logits``."""
    ctx = pipe.context(Request(prompt=text, images=list(images)))
    with torch.inference_mode():
        for name in ("tokenize", "vision_encoder", "prefill"):
            if not (name == "vision_encoder" and not images):
                pipe.stages[name](ctx)
    return ctx


def full_forward_logits(lm, images: list, text: str = PROMPT) -> torch.Tensor:
    """The model's own next-token logits for the whole prompt in one forward (bidirectional
    image masks from ``token_type_ids``)."""
    with torch.inference_mode():
        return lm.model(**oracle_inputs(lm, [user(images, text)])).logits[0, -1]


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("images", [[A], [A, B], []], ids=["one-image", "two-images", "text-only"])
def test_matches_generate(lm, images):
    result = ask(make_pipe(lm), images)
    prompt, tokens = oracle(lm, [user(images, PROMPT)])
    assert result.prompt_ids == prompt and result.token_ids == tokens
    soft = int(lm.config.image_token_id)
    assert result.metrics.get("image_tokens", 0) == prompt.count(soft) == 16 * len(images)


@pytest.mark.parametrize("burst", [1, 8], ids=["single-steps", "bursts"])
def test_prompt_and_answer_longer_than_the_window(lm, burst):
    """The window (8) masks keys in prefill, in single decode steps and in the burst step."""
    pipe = make_pipe(lm, burst=burst)
    result = ask(pipe, [C], text=LONG, n=20)
    prompt, tokens = oracle(lm, [user([C], LONG)], n=20)
    assert len(prompt) > 5 * pipe.pool.window and pipe.pool.window == lm.config.text_config.sliding_window
    assert result.token_ids == tokens


def test_chunked_prefill_never_ends_inside_an_image_block(lm, monkeypatch):
    """chunk_size=5 falls inside both 16-token blocks: each chunk stops at a block's start or
    runs on to its end, and the logits equal one full forward of the model."""
    fed: list[tuple[int, int]] = []
    forward = engine_module.forward

    def record(lm_, pool, chunks, **kwargs):
        fed.extend((c.start, c.start + c.count) for c in chunks if c.count > 1)
        return forward(lm_, pool, chunks, **kwargs)

    monkeypatch.setattr(engine_module, "forward", record)
    pipe = make_pipe(lm, chunk_size=5)
    blocks = lm.family.bidirectional_spans(pipe.tokenize(Request(prompt=PROMPT, images=[A, B])))
    assert len(blocks) == 2 and all(end - start == 16 for start, end in blocks)
    ours = prefilled(pipe, [A, B]).logits[0]
    assert any(end - start > 5 for start, end in fed)  # some chunk ran on to a block's end
    for start, end in fed:
        assert not any(s < end < e for s, e in blocks), (start, end, blocks)
    torch.testing.assert_close(ours, full_forward_logits(lm, [A, B]), atol=1e-5, rtol=1e-5)
    pipe.pool.clear_prefix_cache()
    result = ask(pipe, [A, B])
    assert result.token_ids == oracle(lm, [user([A, B], PROMPT)])[1]


def test_prefix_cache_hit_that_ends_inside_an_image_block(lm):
    """Another question about the same image attaches the cached KV blocks, the last of which
    ends inside the image block (its keys were computed with the whole block in view, which is
    the same image here); the rest of the block is computed in one chunk, past chunk_size."""
    pipe = make_pipe(lm, chunk_size=3)
    ask(pipe, [A], text="Describe it.")
    ctx = prefilled(pipe, [A], "What colour is it?")
    reused = ctx.metrics.to_dict()["kv_reused_tokens"]
    assert any(start < reused < end for start, end in lm.family.bidirectional_spans(ctx))
    torch.testing.assert_close(ctx.logits[0], full_forward_logits(lm, [A], "What colour is it?"), atol=1e-5, rtol=1e-5)
    result = ask(pipe, [A], text="What colour is it?")
    assert result.metrics["kv_reused_tokens"] > reused  # now its own prompt is cached too
    assert result.token_ids == oracle(lm, [user([A], "What colour is it?")])[1]


def test_chat_with_images_and_undo_matches_generate(lm):
    """Each turn equals generate() on the whole conversation; the image stays cached across turns
    (not encoded again), /undo rolls the cache back and the next turn is still exact."""
    chat = ChatSession(make_pipe(lm), max_new_tokens=N, ignore_eos=True, system_prompt="Be brief.")
    system = [{"role": "system", "content": "Be brief."}]
    first = chat.send("Describe it.", images=[A])
    history = [user([A], "Describe it."), {"role": "assistant", "content": first.text}]
    assert first.token_ids == oracle(lm, system + [user([A], "Describe it.")])[1]
    second = chat.send("And the colours?")
    assert second.token_ids == oracle(lm, system + history + [user([], "And the colours?")])[1]
    soft = int(lm.config.image_token_id)
    last_soft = len(second.prompt_ids) - 1 - second.prompt_ids[::-1].index(soft)
    assert second.metrics["kv_reused_tokens"] > last_soft and second.metrics["megapixels"] == 0
    assert chat.undo() is not None and chat.cache.length == second.metrics["kv_reused_tokens"]
    other = chat.send("Compare them.", images=[B])
    messages = system + history + [user([B], "Compare them.")]
    prompt, tokens = oracle(lm, messages)
    assert other.prompt_ids == prompt and other.token_ids == tokens


# --------------------------------------------------------------------------- quantisation, batches


def test_nf4_runs_exactly_and_keeps_the_encoders_unquantised(load_tiny):
    import bitsandbytes as bnb

    lm = load_tiny("gemma3", quant="nf4")
    names = [n for n, m in lm.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert any("language_model.layers" in n for n in names)
    assert not any("vision_tower" in n or "multi_modal_projector" in n for n in names)
    towers = [lm.model.model.vision_tower, lm.model.model.multi_modal_projector]
    assert all(p.dtype == torch.float32 for t in towers for p in t.parameters())
    result = ask(make_pipe(lm), [A])
    assert result.metrics["quant"] == "nf4"
    assert result.token_ids == oracle(lm, [user([A], PROMPT)])[1]


def test_batched_requests_get_their_solo_answers(load_tiny):
    """float64: batched, chunked (blocks cut) and packed with decode rows, each request's tokens
    equal its solo run and generate()."""
    lm = load_tiny("gemma3", dtype="float64")
    cases = [([A], PROMPT), ([], LONG), ([B, C], "Compare the two."), ([], "Hi."), ([C, A], LONG)]
    requests = [
        Request(prompt=text, images=images, max_new_tokens=5 + i, ignore_eos=True)
        for i, (images, text) in enumerate(cases)
    ]
    pipe = make_pipe(lm, chunk_size=12, max_seqs=5, max_batch_tokens=40)
    handles = [pipe.submit(r) for r in requests]
    batched = [h.result(timeout=300) for h in handles]
    one = make_pipe(lm, max_seqs=1)
    for (images, text), request, result in zip(cases, requests, batched):
        one.pool.clear_prefix_cache()
        alone = one.run(request).token_ids
        assert result.token_ids == alone == oracle(lm, [user(images, text)], n=request.max_new_tokens)[1], text


# --------------------------------------------------------------------------- settings and variants


def test_pan_and_scan_when_asked_is_exact(load_tiny):
    """model.processor.do_pan_and_scan=true: a wide image becomes its thumbnail and crops, each
    its own block of soft tokens, hash and encoder row."""
    lm = load_tiny("gemma3", processor_kwargs={"do_pan_and_scan": True})
    wide = picture(1200, 300, 4)
    result = ask(make_pipe(lm), [wide])
    prompt, tokens = oracle(lm, [user([wide], PROMPT)])
    assert result.prompt_ids == prompt and result.token_ids == tokens
    assert result.metrics["image_tokens"] == 5 * 16  # the thumbnail and 4 crops


def test_text_only_gemma3_checkpoint_runs_through_its_family(tmp_path):
    """``gemma3_text`` (Gemma3ForCausalLM, the 1B layout) loads and decodes past its window exactly."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from pipeline.testing import make_tokenizer
    from pipeline.testing.common import _generation_config
    from pipeline.testing.gemma3 import ROLES, text_config

    tok = make_tokenizer("gemma3")
    kwargs = {k: v for k, v in text_config(tok).items() if k != "model_type"}
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**kwargs)).eval()
    model.generation_config = _generation_config(ROLES, tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    assert lm.family.name == "gemma3-text" and lm.processor is None
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(chunk_size=7), "decode": DecodeLoop()})
    result = pipe.run(Request(prompt=LONG, max_new_tokens=16, ignore_eos=True))
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": LONG}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert result.prompt_ids == ids[0].tolist()
    assert result.token_ids == generate_oracle(lm, ids, 16, ignore_eos=True)


def test_model_config_names_the_checkpoint_and_takes_pan_and_scan():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["+model=gemma3"])
        on = compose("config", overrides=["+model=gemma3", "model.processor.do_pan_and_scan=true"])
    assert cfg.model.name == "gemma3" and cfg.model.path == "google/gemma-3-4b-it"
    assert cfg.model.processor.do_pan_and_scan is None  # null: the checkpoint's own setting (off)
    assert on.model.processor.do_pan_and_scan is True
