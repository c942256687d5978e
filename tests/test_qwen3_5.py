"""Qwen3.5 (Gated DeltaNet + gated full attention) through the paged engine answers exactly like
``generate()``: text, one and two images, the text-only model, chunked prefill through images,
prefix-cache hits, batched requests, chat turns and /undo, nf4, and the command line (run, batch,
serve, bench; n-gram speculative decoding, and a Qwen3.5 draft model refused in one line).

Oracle: the model's own processor (or tokenizer) and chat template on the same messages, then
``generate(do_sample=False)``. The cache-level operations on recurrent states (rollback,
snapshots, forks, checkpoints) are ``tests/test_recurrent.py``'s.
"""

from __future__ import annotations

import base64
import json

import bitsandbytes as bnb
import pytest
import torch
from PIL import Image

from conftest import ROOT, generate_oracle, run_cli
from pipeline import Pipeline, Request
from pipeline.frontends.chat_session import ChatSession
from pipeline.media import load_image
from pipeline.model.quant import quantization_config
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder
from test_chat import common
from test_engine import submit_staggered
from test_quant import linears
from test_vision import A, B, C, N, PROMPT, ask, make_pipe, oracle

VL, TEXT = "qwen3.5", "qwen3.5-text"
SHAPES = ROOT / "examples" / "shapes.png"


@pytest.fixture(scope="module")
def vl(load_tiny):
    return load_tiny(VL)


@pytest.fixture(scope="module")
def text(load_tiny):
    return load_tiny(TEXT)


def pipe_for(lm, chunk: int | None = None, **engine) -> Pipeline:
    stages = {
        "tokenize": Tokenize(),
        "vision_encoder": VisionEncoder(),
        "prefill": Prefill(chunk_size=chunk),
        "decode": DecodeLoop(),
    }
    if not lm.family.media:
        del stages["vision_encoder"]
    return Pipeline(lm, stages, **engine)


def text_oracle(lm, messages: list[dict], n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of the text-only model: its tokenizer's template, then generate."""
    ids = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    return ids[0].tolist(), generate_oracle(lm, ids, n, ignore_eos=True)


def chat_oracle(lm, messages: list[dict], images: list[Image.Image]) -> tuple[list[int], list[int]]:
    """A whole conversation (the session's messages) through the processor and generate."""
    if not lm.family.media:
        return text_oracle(lm, messages)
    rendered = lm.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = dict(lm.processor(text=[rendered], images=images or None, return_tensors="pt"))
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    return ids[0].tolist(), generate_oracle(lm, ids, N, ignore_eos=True, **inputs)


def solo_oracle(lm, request: Request) -> list[int]:
    if lm.family.media:
        return oracle(lm, request.images, text=request.prompt)[1]
    return text_oracle(lm, [{"role": "user", "content": request.prompt}])[1]


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("images", [[A], [A, C], []], ids=["one-image", "two-images", "text-only"])
def test_matches_generate(vl, images):
    result = ask(make_pipe(vl), images)
    prompt_ids, tokens = oracle(vl, images)
    assert (result.prompt_ids, result.token_ids) == (prompt_ids, tokens)
    assert result.metrics["image_tokens" if images else "prompt_tokens"] == (
        prompt_ids.count(vl.config.image_token_id) if images else len(prompt_ids)
    )


def test_text_only_model_matches_generate(text):
    result = pipe_for(text).run(Request(prompt=PROMPT, max_new_tokens=N, ignore_eos=True))
    assert (result.prompt_ids, result.token_ids) == text_oracle(text, [{"role": "user", "content": PROMPT}])


def test_chunked_prefill_through_images_and_a_prefix_cache_hit_match_generate(vl):
    """Chunks of 8 end inside both images (and between checkpoints); a second request with the
    same images and another question takes their blocks and recurrent state from the prefix
    cache (checkpoints at every block boundary here) and encodes only what it does not reuse."""
    pipe = pipe_for(vl, chunk=8, kv_state_checkpoint_every=16)
    first = ask(pipe, [C, A])
    assert first.token_ids == oracle(vl, [C, A])[1]
    assert first.metrics["kv_reused_tokens"] == 0 and first.metrics["prefill_tokens"] == len(first.prompt_ids)
    again = ask(pipe, [C, A], text="Which colours?")
    m = again.metrics
    pads = [i for i, t in enumerate(again.prompt_ids) if t == vl.config.image_token_id]
    end_of_c = next(p for p, q in zip(pads, pads[1:]) if q != p + 1)  # C's run of placeholders ends here
    assert pads[-1] >= m["kv_reused_tokens"] > end_of_c  # C reused, A (at least its end) computed
    assert m["kv_reused_tokens"] % 16 == 0 and m["kv_reused_tokens"] <= common(first.prompt_ids, again.prompt_ids)
    assert m["prefill_tokens"] + m["kv_reused_tokens"] == m["prompt_tokens"] == len(again.prompt_ids)
    assert 0 < m["megapixels"] < first.metrics["megapixels"]  # C came from the cache, A was encoded again
    assert again.token_ids == oracle(vl, [C, A], text="Which colours?")[1]


def test_same_prompt_again_reuses_up_to_its_last_block_boundary(vl, text):
    """With the default checkpoint spacing (1024) the prompt's last block boundary still keeps a
    state for the prefix cache, so the same request again (image included) skips the encoder.
    Both prompts here end inside a block: one of whole blocks gets its boundary checkpoint at
    its very end, which a request with the same prompt cannot use (one token is always
    computed), so it reuses nothing (the engine's ``checkpoint_at(total, total - total % bs)``)."""
    pipe = make_pipe(vl)
    first = ask(pipe, [A])
    n = len(first.prompt_ids)
    assert n % 16 and n > 16  # the boundary lies inside the prompt
    again = ask(pipe, [A])
    reused = again.metrics["kv_reused_tokens"]
    pads = [i for i, t in enumerate(again.prompt_ids) if t == vl.config.image_token_id]
    assert reused == n - n % 16 > pads[-1]  # the whole image comes from the cache ...
    assert again.metrics["megapixels"] == 0 and again.metrics["prefill_tokens"] == n - reused  # ... not the encoder
    assert again.token_ids == first.token_ids == oracle(vl, [A])[1]
    request = Request(prompt="Tell me about the sea, the sky and the land.", max_new_tokens=N, ignore_eos=True)
    once, twice = (pipe_for(text, chunk=5).run(request) for _ in range(2))
    k = len(once.prompt_ids)
    assert k % 16  # (a prompt of whole blocks has its last boundary at its end: see the note above)
    assert twice.metrics["kv_reused_tokens"] == (k - 1) - (k - 1) % 16 > 0
    assert twice.token_ids == once.token_ids == solo_oracle(text, request)


def test_batched_requests_each_get_their_generate_answer(vl, text):
    """Staggered arrivals packed into shared steps, prefilled in chunks of 16: each answer is
    the one generate() gives the request alone, images or not, on both models."""
    prompts = [[A], [B, C], [], [C], [A, B]]
    requests = [
        Request(prompt=f"{PROMPT} {i}", images=imgs, max_new_tokens=N, ignore_eos=True)
        for i, imgs in enumerate(prompts)
    ]
    batched = submit_staggered(pipe_for(vl, chunk=16, max_seqs=5), requests)
    assert [r.token_ids for r in batched] == [solo_oracle(vl, r) for r in requests]
    words = ["Hi.", "Tell me about the sea and the sky, please.", "Count to five.", "Why is the sky blue today?"]
    requests = [Request(prompt=w, max_new_tokens=N + i, ignore_eos=True) for i, w in enumerate(words)]
    batched = submit_staggered(pipe_for(text, chunk=8, max_seqs=4), requests)
    assert [r.token_ids for r in batched] == [
        text_oracle(text, [{"role": "user", "content": r.prompt}], r.max_new_tokens)[1] for r in requests
    ]


# --------------------------------------------------------------------------- chat


@pytest.mark.parametrize("family", [VL, TEXT])
def test_chat_turns_and_undo_equal_a_fresh_run(load_tiny, family):
    """Every turn (the first one with an image on the VL model) equals generate() on the whole
    conversation; /undo rolls the recurrent state back to a checkpoint, and the next turn counts
    what it recomputes in prefill_tokens."""
    lm = load_tiny(family)
    chat = ChatSession(pipe_for(lm), max_new_tokens=N, ignore_eos=True)
    images = [A] if lm.family.media else []
    results = []
    held: list[int] = []  # the ids the session's cache holds (its keys carry image hashes instead)
    for i, message in enumerate(["What is in the picture?", "Tell me more.", "And the colours?"]):
        result = chat.send(message, images=images if i == 0 else [])
        assert (result.prompt_ids, result.token_ids) == chat_oracle(lm, chat.messages[:-1], images), i
        m = result.metrics
        assert m["prefill_tokens"] + m["kv_reused_tokens"] == m["prompt_tokens"] == len(result.prompt_ids)
        assert m["kv_reused_tokens"] <= common(held, result.prompt_ids)
        held = result.prompt_ids + result.token_ids[:-1]
        assert len(chat.cache.keys) == len(held)
        if i:  # reused up to a checkpoint before the template's rewrite of the last answer
            assert 0 < m["kv_reused_tokens"] and m.get("megapixels", 0) == 0
            if images:  # the image is in the reused part: never encoded again
                pads = [k for k, t in enumerate(result.prompt_ids) if t == lm.config.image_token_id]
                assert m["kv_reused_tokens"] > pads[-1]
        results.append(result)
    undone = chat.undo()
    assert undone.result is results[-1] and len(chat.turns) == 2
    assert 0 < chat.cache.length <= undone.kept
    kept = chat.cache.length
    other = chat.send("What is a cloud?")
    assert (other.prompt_ids, other.token_ids) == chat_oracle(lm, chat.messages[:-1], images)
    m = other.metrics
    # what the rollback kept is reused; past it (the undone turn's history the template shares
    # with this prompt) the recurrent state must be recomputed from the checkpoint
    assert kept <= m["kv_reused_tokens"] <= common(results[-1].prompt_ids, other.prompt_ids)
    assert m["prefill_tokens"] + m["kv_reused_tokens"] == m["prompt_tokens"] == len(other.prompt_ids)
    assert m.get("megapixels", 0) == 0
    # Back to the first turn, and its second message again: the same answer as the first time,
    # from whatever state the rollback (or the prefix cache) has, the rest counted as computed.
    chat.undo()
    chat.undo()
    assert chat.cache.length <= len(results[0].prompt_ids) + N
    again = chat.send("Tell me more.")
    assert (again.prompt_ids, again.token_ids) == (results[1].prompt_ids, results[1].token_ids)
    assert again.metrics["prefill_tokens"] + again.metrics["kv_reused_tokens"] == len(again.prompt_ids)


# --------------------------------------------------------------------------- nf4


def test_nf4_keeps_the_tower_and_the_deltanet_gates_unquantised_and_matches_generate(load_tiny):
    """bitsandbytes' CPU 4-bit kernel cannot pack in_proj_a / in_proj_b (one output per value
    head): the family keeps them unquantised, with the vision tower and lm_head."""
    lm = load_tiny(VL, quant="nf4")
    assert lm.quant == "nf4"
    plain = [n for n, _ in linears(lm.model, torch.nn.Linear)]
    four_bit = [n for n, _ in linears(lm.model, bnb.nn.Linear4bit)]
    gates = [n for n in plain if n.startswith("model.language_model.")]
    assert gates and all(n.endswith(("linear_attn.in_proj_a", "linear_attn.in_proj_b")) for n in gates)
    assert len(gates) == 2 * lm.config.text_config.layer_types.count("linear_attention")
    assert any(n.startswith("model.visual.") for n in plain)
    assert all(n.startswith("model.visual.") or n in gates or n == "lm_head" for n in plain)
    assert four_bit and all(n.startswith("model.language_model.") for n in four_bit)
    assert any(".linear_attn.in_proj_qkv" in n for n in four_bit) and any(".self_attn." in n for n in four_bit)
    for images in ([A], []):
        result = ask(make_pipe(lm), images)
        assert (result.prompt_ids, result.token_ids) == oracle(lm, images)


def test_nf4_text_only_model_matches_generate(load_tiny):
    lm = load_tiny(TEXT, quant="nf4")
    assert lm.quant == "nf4" and {n.rsplit(".", 1)[-1] for n, _ in linears(lm.model, torch.nn.Linear)} == {
        "in_proj_a",
        "in_proj_b",
        "lm_head",
    }
    result = pipe_for(lm, chunk=8).run(Request(prompt=PROMPT, max_new_tokens=N, ignore_eos=True))
    assert (result.prompt_ids, result.token_ids) == text_oracle(lm, [{"role": "user", "content": PROMPT}])


def test_family_unquantised_modules_survive_an_explicit_skip_list(vl):
    """quant.skip_modules replaces the default skips (lm_head, encoders) but never the layers
    bitsandbytes cannot pack."""
    unquantised = vl.family.unquantised_modules
    assert set(unquantised) == {"in_proj_a", "in_proj_b"}
    patterns = quantization_config({"name": "nf4", "skip_modules": []}, unquantised=unquantised).llm_int8_skip_modules
    from transformers.quantizers.quantizers_utils import should_convert_module

    assert not should_convert_module("model.language_model.layers.0.linear_attn.in_proj_a", patterns)
    assert not should_convert_module("model.layers.2.linear_attn.in_proj_b", patterns)
    assert should_convert_module("model.language_model.layers.0.linear_attn.in_proj_qkv", patterns)
    assert should_convert_module("model.visual.blocks.0.attn.qkv", patterns)  # the explicit list said so
    assert quantization_config({"name": "nf4", "skip_modules": []}).llm_int8_skip_modules == []


# --------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def shapes_oracle(vl):
    """What generate() answers about examples/shapes.png with the default image question."""
    return oracle(vl, [load_image(SHAPES)], text="Describe this image.")


@pytest.mark.slow  # the CLI path; both behaviours are checked in-process (test_recurrent)
def test_cli_image_matches_generate_and_a_recurrent_draft_model_is_refused(
    tiny_dir, vl, shapes_oracle, tmp_path, monkeypatch
):
    args = [f"model.path={tiny_dir(VL)}", f"input={SHAPES}", f"max_new_tokens={N}", "ignore_eos=true"]
    proc = run_cli(*args, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert (result["prompt_ids"], result["token_ids"]) == shapes_oracle
    assert proc.stdout == result["text"] + "\n"
    assert result["metrics"]["image_tokens"] == shapes_oracle[0].count(vl.config.image_token_id)
    # the refusal is a UserError, which the CLI prints as one line with exit 2 (tests/test_cli.py);
    # here in this process, to spare a second interpreter start
    from pipeline.errors import UserError
    from pipeline.modes import run
    from test_batch import compose_cfg

    monkeypatch.setattr(run, "run_dir", lambda: tmp_path / "spec")
    with pytest.raises(UserError, match="decode.draft_model has linear-attention layers"):
        run.main(compose_cfg(*args, "decode.speculative=draft", f"decode.draft_model={tiny_dir(TEXT)}"))
    assert not (tmp_path / "spec").exists()


def test_ngram_speculative_run_mode_matches_generate(tiny_dir, vl, tmp_path, monkeypatch):
    """``decode.speculative=ngram`` on a recurrent target (mode=run, in this process): the
    drafts it verifies are rejected and the states rolled back, and the answer is generate()'s."""
    from pipeline.modes import run
    from test_batch import compose_cfg

    monkeypatch.setattr(run, "run_dir", lambda: tmp_path)
    run.main(
        compose_cfg(
            f"model.path={tiny_dir(VL)}",
            f"input={SHAPES}",
            "max_new_tokens=24",
            "ignore_eos=true",
            "decode.speculative=ngram",
            "stream=false",
        )
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["prompt_ids"], result["token_ids"]) == oracle(
        vl, [load_image(SHAPES)], text="Describe this image.", n=24
    )
    assert result["metrics"]["spec_drafted"] > 0


@pytest.mark.slow  # serve and batch over images run for Qwen2-VL in the default run
def test_served_and_batched_image_answers_equal_generate(tiny_dir, vl, shapes_oracle, tmp_path, monkeypatch):
    """The same image request over the OpenAI API (``mode=serve``) and as a ``mode=batch`` line."""
    from openai import OpenAI
    from serving import serving

    from pipeline.modes import batch, processes
    from test_batch import compose_cfg

    prompt_ids, tokens = shapes_oracle
    png = "data:image/png;base64," + base64.b64encode(SHAPES.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "Describe this image."}]
    with serving(tmp_path, f"model.path={tiny_dir(VL)}") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(
            model=str(tiny_dir(VL)),
            messages=[{"role": "user", "content": content}],
            max_tokens=N,
            extra_body={"ignore_eos": True},
        )
    assert got.choices[0].message.content == vl.tokenizer.decode(tokens, skip_special_tokens=True)
    assert got.usage.prompt_tokens == len(prompt_ids) and got.usage.completion_tokens == N

    items = tmp_path / "items.jsonl"
    items.write_text(
        json.dumps(
            {
                "id": "a",
                "prompt": "Describe this image.",
                "images": [str(SHAPES)],
                "max_new_tokens": N,
                "ignore_eos": True,
            }
        )
        + "\n"
    )
    out = tmp_path / "batch"
    out.mkdir()
    monkeypatch.setattr(processes, "run_dir", lambda: out)
    batch.main(compose_cfg("mode=batch", "batch.progress=false", f"input={items}", f"model.path={tiny_dir(VL)}"))
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["id"], r["token_ids"]) for r in rows] == [("a", tokens)]


def test_bench_runs_with_the_hf_baseline(tiny_dir, tmp_path, monkeypatch, capsys):
    from pipeline.modes import bench
    from test_bench import make_cfg

    monkeypatch.chdir(tmp_path)
    bench.main(
        make_cfg(
            f"model.path={tiny_dir(VL)}",
            "bench.prompt_lengths=[4,20]",
            "bench.gen_lengths=[3]",
            "bench.repetitions=1",
            "bench.warmup=0",
            "bench.baseline=hf",
        )
    )
    body = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| pp")]
    assert [line.split("|")[1].strip() for line in body] == ["pp4+tg3", "pp20+tg3"]
    data = json.loads((tmp_path / "bench.json").read_text())
    for row in data["rows"]:
        assert all(s["tg_tok_s"] > 0 for s in row["pipeline"]["samples"]) and row["ratio"]["pptg_tok_s"] > 0
