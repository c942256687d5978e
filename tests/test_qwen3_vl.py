"""Qwen3-VL: images (and their deepstack features) through the paged engine answer exactly like
``generate()``: alone, chunked, batched with other requests, after a cache hit, and in nf4."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

from conftest import generate_oracle, image_chat_inputs
from pipeline import Pipeline, Request
from pipeline.media import load_video
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder
from test_engine import submit_staggered
from test_quant import linears
from test_vision import A, B, C, N, PROMPT, ask, make_pipe, oracle

FAMILY = "qwen3-vl"


@pytest.mark.parametrize("images", [[A], [A, C], []], ids=["one-image", "two-images", "text-only"])
def test_matches_generate(load_tiny, images):
    lm = load_tiny(FAMILY)
    result = ask(make_pipe(lm), images)
    prompt_ids, tokens = oracle(lm, images)
    assert result.prompt_ids == prompt_ids
    assert result.token_ids == tokens


def test_deepstack_features_reach_the_decoder(load_tiny, monkeypatch):
    """Without the deepstack additions the answer differs: the exactness above depends on them."""
    from pipeline.families.qwen3_vl import Qwen3VLFamily

    lm = load_tiny(FAMILY)
    monkeypatch.setattr(Qwen3VLFamily, "chunk_extras", lambda self, ctx, begin, end: None)
    assert ask(make_pipe(lm), [A, C]).token_ids != oracle(lm, [A, C])[1]


def test_chunked_prefill_and_a_cached_image_match_generate(load_tiny):
    lm = load_tiny(FAMILY)
    stages = {
        "tokenize": Tokenize(),
        "vision_encoder": VisionEncoder(),
        "prefill": Prefill(chunk_size=8),
        "decode": DecodeLoop(),
    }
    pipe = Pipeline(lm, stages)
    expected = oracle(lm, [C, A])[1]
    first = ask(pipe, [C, A])
    assert first.token_ids == expected  # chunk borders fall inside the images
    again = ask(pipe, [C, A], text="Which colours?")  # the prefix cache holds C (full blocks)
    assert again.metrics["kv_reused_tokens"] > 0 and again.metrics["megapixels"] < first.metrics["megapixels"]
    assert again.token_ids == oracle(lm, [C, A], text="Which colours?")[1]


def test_batched_requests_each_get_their_solo_answer(load_tiny):
    """Several prompts' deepstack rows packed into one forward, in packed token order."""
    lm = load_tiny(FAMILY)
    requests = [
        Request(prompt=f"{PROMPT} {i}", images=imgs, max_new_tokens=N, ignore_eos=True)
        for i, imgs in enumerate([[A], [B, C], [], [C], [A, B]])
    ]
    batched = submit_staggered(
        Pipeline(
            lm,
            {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()},
            max_seqs=5,
        ),
        requests,
    )
    for request, result in zip(requests, batched):
        assert result.token_ids == oracle(lm, request.images, text=request.prompt)[1]


def test_nf4_keeps_the_tower_and_deepstack_mergers_unquantised_and_matches_generate(load_tiny):
    lm = load_tiny(FAMILY, quant="nf4")
    plain = [n for n, _ in linears(lm.model, torch.nn.Linear)]
    four_bit = [n for n, _ in linears(lm.model, bnb.nn.Linear4bit)]
    assert any(".deepstack_merger_list." in n for n in plain)
    assert plain and all(n.startswith("model.visual.") or n == "lm_head" for n in plain)
    assert four_bit and all(n.startswith("model.language_model.") for n in four_bit)
    ids, inputs = image_chat_inputs(lm, [A], PROMPT)
    assert ask(make_pipe(lm), [A]).token_ids == generate_oracle(lm, ids, N, ignore_eos=True, **inputs)


@pytest.mark.parametrize("kinds", [["video"], ["image", "video"]], ids=["video", "image-then-video"])
def test_video_matches_generate(load_tiny, tmp_path, kinds):
    """One placeholder run per temporal patch with timestamp text between: the text keeps its own
    embeddings, the runs get the tower's, and their deepstack rows go to the decoder."""
    from test_video import drawn, oracle as video_oracle, write_clip

    lm = load_tiny(FAMILY)
    clip = write_clip(tmp_path / "clip.mp4", drawn(16), 8, "mpeg4")
    images = [A] if "image" in kinds else []
    request = Request(
        prompt=PROMPT,
        images=images,
        videos=[load_video(clip, fps=4)],
        media_order=kinds,
        max_new_tokens=N,
        ignore_eos=True,
    )
    result = make_pipe(lm).run(request)
    prompt_ids, tokens = video_oracle(lm, kinds, images, [clip], fps=4, text=PROMPT, n=N)
    assert (result.prompt_ids, result.token_ids) == (prompt_ids, tokens)
    assert result.metrics["video_tokens"] == prompt_ids.count(lm.config.video_token_id)
    assert result.metrics["video_frames"] == 8
