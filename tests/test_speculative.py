"""Speculative decoding (``decode.speculative``): the same tokens as plain greedy decoding and as
``model.generate(do_sample=False)``, for prompt lookup and for a draft model, in every family;
rejected drafts leave the KV cache exactly as a fresh prefill of the kept tokens; speculative
sampling draws from the target's distribution.

The drafts here are partly right and partly wrong, so both the accepted and the rolled-back
paths run: prompts that repeat themselves for n-gram lookup, and for the draft model a copy of
the target with noise added to its weights (same tokenizer, often the same argmax, not always).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import generate_oracle, image_chat_inputs, run_cli
from pipeline import Pipeline, Request, UserError, load_model
from pipeline.frontends.chat_session import ChatSession
from pipeline.spec import NgramDrafter, Speculative, check_same_tokenizer, check_settings, verify
from stages import AudioEncoder, DecodeLoop, Prefill, Sampler, Tokenize, VisionEncoder

N = 24
RATE = 16_000
REPEATING = "the cat sat on the mat and the dog sat on the log; the cat sat on the mat and the dog sat on"
FAMILIES = ["qwen3", "llama", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen2-audio", "gemma3"]


def noisy_copy(src, dest, scale: float = 0.3, seed: int = 0):
    """A draft that agrees with the target often but not always: its weights plus noise."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    weights = load_file(dest / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    noisy = {
        k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1 else v
        for k, v in weights.items()
    }
    save_file(noisy, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def drafts(tiny_dir, tmp_path_factory):
    """drafts(family) -> a loaded noisy copy of that family's tiny model (same tokenizer)."""
    made: dict = {}
    base = tmp_path_factory.mktemp("drafts")

    def get(family: str):
        if family not in made:
            made[family] = load_model(str(noisy_copy(tiny_dir(family), base / family)), dtype=torch.float32)
        return made[family]

    return get


def pipe_for(lm, spec: Speculative | None = None, sampler: Sampler | None = None, **engine) -> Pipeline:
    stages = {"tokenize": Tokenize()}
    if set(lm.family.media) & {"image", "video"}:
        stages["vision_encoder"] = VisionEncoder()
    if "audio" in lm.family.media:
        stages["audio_encoder"] = AudioEncoder()
    stages.update(prefill=Prefill(), decode=DecodeLoop(sampler or Sampler(), speculative=spec))
    return Pipeline(lm, stages, **engine)


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8), "RGB")


def wave() -> torch.Tensor:
    t = torch.arange(RATE) / RATE
    return (0.4 * torch.sin(2 * torch.pi * 440 * t)).float()


def request_for(lm, prompt: str = REPEATING, n: int = N) -> Request:
    """The family's media (an image, or a clip) with a prompt that repeats itself."""
    if "image" in lm.family.media:
        return Request(prompt=prompt, images=[picture(1)], max_new_tokens=n, ignore_eos=True)
    if "audio" in lm.family.media:
        return Request(prompt=prompt, audios=[(wave(), RATE)], max_new_tokens=n, ignore_eos=True)
    return Request(prompt=prompt, max_new_tokens=n, ignore_eos=True)


def oracle(lm, prompt: str = REPEATING, n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, generate() tokens) for what ``request_for`` asks, built by the model's own
    processor or tokenizer from the same message."""
    if "image" in lm.family.media:
        ids, inputs = image_chat_inputs(lm, [picture(1)], prompt)
        return ids[0].tolist(), generate_oracle(lm, ids, n, ignore_eos=True, **inputs)
    if "audio" in lm.family.media:
        content = [{"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": prompt}]
        text = lm.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        inputs = dict(lm.processor(text=[text], audio=[wave().numpy()], sampling_rate=RATE, return_tensors="pt"))
    else:
        inputs = dict(
            lm.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        )
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    return ids[0].tolist(), generate_oracle(lm, ids, n, ignore_eos=True, **inputs)


# ----------------------------------------------------------------------------- exactness


class KnowingDrafter:
    """Drafts the right answer (read from a plain run) with its last draft each round made wrong:
    every verify step keeps k - 1 drafts and rolls one back, whatever the random model says."""

    def __init__(self, answer: list[int], prompt_len: int) -> None:
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, ids, k, sampler=None):
        done = len(ids) - self.prompt_len
        drafts = list(self.answer[done : done + k])
        if len(drafts) > 1:
            drafts[-1] = (drafts[-1] + 1) % 64  # an ordinary token other than the right one
        return drafts, None

    def close(self) -> None:
        pass


class Knowing(Speculative):
    def __init__(self, answer: list[int], prompt_len: int) -> None:
        super().__init__("ngram", num_draft=4)
        self.answer, self.prompt_len = answer, prompt_len

    def drafter(self) -> KnowingDrafter:
        return KnowingDrafter(self.answer, self.prompt_len)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_methods_give_the_tokens_of_generate(load_tiny, drafts, family):
    """Prompt lookup, the draft model, and drafts known to be partly right (so accepted drafts
    and rollbacks both happen, at this family's positions, after its media): generate()'s tokens.
    48 tokens: long enough for a random model's answer to reuse tokens, so lookup drafts."""
    lm = load_tiny(family)
    prompt_ids, want = oracle(lm, n=48)
    specs = {
        "ngram": Speculative("ngram", num_draft=4),
        "draft": Speculative("draft", num_draft=3, draft=drafts(family)),
        "knowing": Knowing(want, len(prompt_ids)),
    }
    for name, spec in specs.items():
        got = pipe_for(lm, spec).run(request_for(lm, n=48))
        assert got.prompt_ids == prompt_ids
        assert got.token_ids == want, name
        m = got.metrics
        assert m["spec_drafted"] > 0 and m["spec_accepted"] < m["spec_drafted"], (name, m)  # rolled back
    assert m["spec_accepted"] == m["spec_drafted"] * 3 // 4 and m["spec_tokens_per_step"] > 3, m


def test_ngram_drafts_are_kept_where_the_answer_repeats(load_tiny):
    """A random model's answer comes back to its own tokens now and then: lookup drafts what
    followed them last time, and some of those drafts are right (7 of 61 here)."""
    lm = load_tiny("qwen3")
    plain = pipe_for(lm).run(request_for(lm, n=100))
    got = pipe_for(lm, Speculative("ngram", num_draft=4)).run(request_for(lm, n=100))
    assert got.token_ids == plain.token_ids
    m = got.metrics
    assert 0 < m["spec_accepted"] < m["spec_drafted"] and m["spec_tokens_per_step"] > 1.0, m


def test_rollback_leaves_the_cache_equal_to_a_fresh_prefill(load_tiny, drafts):
    lm = load_tiny("qwen3")
    pipe = pipe_for(lm, Speculative("draft", num_draft=4, draft=drafts("qwen3")))
    cache = pipe.new_cache()
    result = pipe.run(request_for(lm, n=40), cache=cache)
    assert result.metrics["spec_accepted"] < result.metrics["spec_drafted"]  # drafts were rolled back
    kept = result.prompt_ids + result.token_ids[:-1]  # the last token is not fed yet
    assert cache.keys == kept
    with torch.inference_mode():
        fresh = lm.model(torch.tensor([kept], device=lm.device), use_cache=True).past_key_values
    bs = cache.block_size
    slots = torch.tensor([cache.blocks[p // bs] * bs + p % bs for p in range(len(kept))], device=lm.device)
    for layer in range(len(fresh.layers)):
        k, v = pipe.pool.layer_kv(layer)
        torch.testing.assert_close(k[slots], fresh.layers[layer].keys[0].transpose(0, 1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v[slots], fresh.layers[layer].values[0].transpose(0, 1), rtol=1e-4, atol=1e-4)


def test_sequences_batched_together_get_their_solo_tokens(load_tiny, drafts):
    lm = load_tiny("qwen2-vl")
    prompts = [REPEATING, "one two three one two three one two", "Describe the picture.", REPEATING[:40]]
    solo = [pipe_for(lm).run(request_for(lm, p)).token_ids for p in prompts]
    for spec in (Speculative("ngram", num_draft=5), Speculative("draft", num_draft=2, draft=drafts("qwen2-vl"))):
        pipe = pipe_for(lm, spec, max_seqs=4)
        handles = [pipe.submit(request_for(lm, p)) for p in prompts]
        assert [h.result(timeout=300).token_ids for h in handles] == solo, spec.method


def test_compiled_draft_steps_draft_what_the_eager_draft_drafts(load_tiny, drafts):
    """``decode.draft_compile``: the draft's greedy bursts under torch.compile (aot_eager: the
    same graph capture, no code generation) give the same drafts, so the same acceptance."""
    lm = load_tiny("qwen3")
    _, want = oracle(lm, n=40)
    eager = Speculative("draft", num_draft=4, draft=drafts("qwen3"))
    compiled = Speculative(
        "draft", num_draft=4, draft=drafts("qwen3"), compile=True, compile_backend="aot_eager", draft_memory=1 << 20
    )  # small: aot_eager copies the mutated pool on every step
    results = [pipe_for(lm, spec).run(request_for(lm, n=40)) for spec in (eager, compiled)]
    assert [r.token_ids for r in results] == [want, want]
    assert results[0].metrics["spec_accepted"] == results[1].metrics["spec_accepted"] > 0
    assert compiled.compiled._step is not None and compiled.compiled.broken is None
    assert eager.compiled is None and Speculative("ngram", compile=True).compiled is None  # n-gram has no model


def test_draft_compile_follows_decode_compile_unless_set(tiny_dir, load_tiny):
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    from pipeline.cli.assemble import speculative_from_cfg

    draft = [f"decode.draft_model={tiny_dir('qwen3')}", "decode.speculative=draft"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfgs = [
            compose(config_name="config", overrides=draft + extra)
            for extra in (
                [],
                ["decode.compile=true"],
                ["decode.compile=true", "decode.draft_compile=false"],
                ["decode.draft_compile=true"],
            )
        ]
    lm = load_tiny("qwen3")
    assert [speculative_from_cfg(cfg, lm).compiled is not None for cfg in cfgs] == [False, True, False, True]


def test_chat_turns_and_undo_stay_exact(load_tiny):
    lm = load_tiny("qwen3")
    plain = ChatSession(pipe_for(lm), max_new_tokens=16)
    spec = ChatSession(pipe_for(lm, Speculative("ngram", num_draft=3)), max_new_tokens=16)
    for text in ("the cat sat on the mat, the cat sat on", "and the dog? the dog sat on the"):
        assert spec.send(text).token_ids == plain.send(text).token_ids
    spec.undo()
    plain.undo()
    again = "the cat sat on the mat again"
    assert spec.send(again).token_ids == plain.send(again).token_ids


def test_eos_inside_accepted_drafts_ends_there(tiny_dir, drafts):
    lm = load_model(str(tiny_dir("qwen3")), dtype=torch.float32)  # its own copy: its EOS is changed below
    full = pipe_for(lm).run(request_for(lm, n=30))
    lm.model.generation_config.eos_token_id = full.token_ids[5]  # a draft round runs past this EOS
    want = pipe_for(lm).run(Request(prompt=REPEATING, max_new_tokens=30))
    pipe = pipe_for(lm, Speculative("draft", num_draft=8, draft=drafts("qwen3")))
    cache = pipe.new_cache()
    got = pipe.run(Request(prompt=REPEATING, max_new_tokens=30), cache=cache)
    assert got.token_ids == want.token_ids == full.token_ids[:6] and got.finish_reason == "eos"
    assert cache.keys == got.prompt_ids + got.token_ids[:-1]  # nothing cached past the end


# ----------------------------------------------------------------------------- sampling


def test_ngram_lookup_takes_the_latest_match_and_the_longest_suffix():
    d = NgramDrafter(ngram_max=3, ngram_min=1)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3], 2)[0] == [7, 8]  # (2, 3) last seen before 7, 8
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3, 7], 3)[0] == [8, 2, 3]  # grows incrementally
    assert NgramDrafter(3, 2).propose([5, 6, 7, 8], 4) == ([], None)  # nothing to look up


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # never a token the target gives no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("drafter", ["point", "distribution"])
def test_speculative_sampling_draws_from_the_target_distribution(drafter):
    """Token frequencies of the first two kept tokens against the target's own probabilities
    (chi-square, 4000 seeded draws, critical value at p = 0.001)."""
    vocab = 6
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 1.5  # the target after the prefix, after d0, after d1
    q = torch.softmax(torch.randn(2, vocab, generator=g), dim=-1)
    sampler = Sampler(temperature=1.0, seed=1234)
    first, second = np.zeros(vocab), np.zeros((vocab, vocab))
    draws = 4000
    rng = np.random.default_rng(0)
    for _ in range(draws):
        if drafter == "point":  # the target's likeliest tokens, as a lookup would often propose
            drafts, dist = [int(logits[0].argmax()), int(logits[1].argmax())], None
        else:
            drafts = [int(rng.choice(vocab, p=q[0].numpy())), int(rng.choice(vocab, p=q[1].numpy()))]
            dist = q
        out, _ = verify(sampler, logits, drafts, dist, [])
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    p0 = torch.softmax(logits[0], -1).numpy()
    critical_5 = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    assert chi_square(first, p0) < critical_5
    if drafter == "point":  # given the first kept token was the first draft, the second follows row 1
        given = second[drafts[0]]
        assert given.sum() > 300
        assert chi_square(given, torch.softmax(logits[1], -1).numpy()) < critical_5


def test_seeded_speculative_sampling_is_reproducible(load_tiny):
    lm = load_tiny("qwen3")
    runs = [
        pipe_for(lm, Speculative("ngram", num_draft=4), Sampler(temperature=0.8, seed=7)).run(request_for(lm))
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].metrics["spec_drafted"] > 0


# ----------------------------------------------------------------------------- settings


def test_bad_settings_are_refused():
    with pytest.raises(UserError, match="decode.num_draft"):
        check_settings("ngram", 0, 3, 1, has_draft=False)
    with pytest.raises(UserError, match="ngram_min"):
        check_settings("ngram", 4, 2, 3, has_draft=False)
    with pytest.raises(UserError, match="decode.speculative must be one of"):
        check_settings("medusa", 4, 3, 1, has_draft=False)
    with pytest.raises(UserError, match="needs a draft model"):
        check_settings("draft", 4, 3, 1, has_draft=False)


def test_a_sampler_of_another_kind_is_refused(load_tiny):
    class Argmax:
        def __call__(self, logits, previous_ids=None):
            return logits.argmax(dim=-1)

    lm = load_tiny("qwen3")
    pipe = Pipeline(
        lm,
        {
            "tokenize": Tokenize(),
            "prefill": Prefill(),
            "decode": DecodeLoop(Argmax(), speculative=Speculative("ngram")),
        },
    )
    with pytest.raises(UserError, match="speculative decoding needs a stages.Sampler"):
        pipe.run(Request(prompt="hi", max_new_tokens=2))


def test_draft_with_another_tokenizer_is_refused(load_tiny):
    check_same_tokenizer(load_tiny("qwen3").tokenizer, load_tiny("qwen3").tokenizer)
    with pytest.raises(UserError, match="another tokenizer"):
        check_same_tokenizer(load_tiny("qwen3").tokenizer, load_tiny("gemma3").tokenizer)


@pytest.mark.slow  # a second process end to end (python -m pytest -m slow)
def test_cli_refuses_before_loading_and_runs_ngram(tiny_dir, tmp_path):
    target = tiny_dir("qwen3")
    bad = run_cli(
        f"model.path={target}",
        "decode.speculative=draft",
        f"decode.draft_model={tiny_dir('gemma3')}",
        f"hydra.run.dir={tmp_path / 'bad'}",
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "another tokenizer" in bad.stderr and "Loading weights" not in bad.stderr
    ok = run_cli(
        f"model.path={target}",
        "prompt=one two three one two three one two",
        "decode.speculative=ngram",
        "max_new_tokens=12",
        "ignore_eos=true",
        f"hydra.run.dir={tmp_path / 'ok'}",
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    metrics = json.loads((tmp_path / "ok" / "result.json").read_text())["metrics"]
    assert metrics["spec_drafted"] > 0 and "spec_accept_rate" in metrics and "spec_tokens_per_step" in metrics
    assert "spec_accept_rate" in ok.stderr  # in the metrics table
