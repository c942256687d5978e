"""Every engine feature on the weights ``quant=auto`` picks for a real checkpoint (issue 46).

On a CPU, ``quant=auto`` loads any checkpoint the project did not build in int8 weight-only
(``int8wo``): the path users get by default. The suite's own tiny models are exempt (their marker
file), so here each one is copied without the marker, a held-out model as a user would bring,
and loaded with ``quant="auto"``. The oracle is ``generate()`` (and a plain forward's
log-softmax) on the same quantised weights, token for token. The default run keeps one int8wo
case of each feature; the same cases on full-precision weights are slow.
"""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path
from typing import Callable

import jsonschema
import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image

from conftest import clear_prefix_caches, generate_oracle, image_chat_inputs, logprob_oracle, run_cli
from serving import serving
from test_batch import prompt_ids, run_batch
from test_speculative import REPEATING, Knowing, noisy_copy
from pipeline import KVCache, Pipeline, Request, load_model
from pipeline.model.loading import LoadedModel
from pipeline.memory import kv_bytes
from pipeline.frontends.chat_session import ChatSession
from pipeline.modes import batch
from pipeline.modes.chat import Repl
from pipeline.runner import matvec
from pipeline.spec import Speculative
from pipeline.structured.tools import call_grammar, parse, tool_format
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

N = 12
TEXT = "qwen3"
VL = "qwen2-vl"
# How each scheme loads a held-out checkpoint: int8wo is what quant=auto picks on a CPU (the fixture
# asserts it), none the checkpoint's own float32 weights, bf16 its weights in bfloat16.
LOADS = {
    "int8wo": dict(quant="auto", dtype=torch.float32),
    "none": dict(quant="none", dtype=torch.float32),
    "bf16": dict(quant="none", dtype=torch.bfloat16),
}
IN_FORCE = {"int8wo": "int8wo", "none": "none", "bf16": "none"}  # what lm.quant reads for each
SCHEMES = ["int8wo", pytest.param("none", marks=pytest.mark.slow)]
# bf16 weights too, where the answer does not hang on a near tie: logits of 8 significant bits tie
# exactly now and then, and a speculative verify or a batch of another shape may take the other of
# two tied tokens (the exactness contract is float32's, up to true near-ties)
WITH_BF16 = [*SCHEMES, pytest.param("bf16", marks=pytest.mark.slow)]


def words(rng: random.Random, n: int) -> str:
    vocab = "sea sky cloud river stone light wind tree bird song night day fire snow rain road".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def picture(seed: int, w: int = 112, h: int = 84) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


# --- held-out models ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def held_out(held_out_dir, tmp_path_factory) -> Callable[[str], Path]:
    """held_out(family) -> that tiny model without the project's marker (``held_out_dir``): to
    quant=auto, a checkpoint a user brought; held_out("<family>-draft"): a noisy copy of it, a
    draft model of the same tokenizer that agrees with it often but not always."""
    base = tmp_path_factory.mktemp("drafts")
    drafts: dict[str, Path] = {}

    def get(name: str) -> Path:
        family = name.removesuffix("-draft")
        if family == name:
            return held_out_dir(family)
        if name not in drafts:
            drafts[name] = noisy_copy(held_out_dir(family), base / name)
        return drafts[name]

    return get


@pytest.fixture(scope="module")
def models(held_out) -> Callable[[str, str], LoadedModel]:
    """models(name, scheme) -> the held-out model loaded once per module under that scheme."""
    loaded: dict[tuple[str, str], LoadedModel] = {}

    def get(name: str, scheme: str) -> LoadedModel:
        if (name, scheme) not in loaded:
            if scheme == "int8wo" and (why := matvec.load()) is not None:
                pytest.skip(f"quant=auto keeps full precision without the native kernel: {why}")
            lm = load_model(str(held_out(name)), **LOADS[scheme])
            assert lm.quant == IN_FORCE[scheme], (
                f"{name}: quant={LOADS[scheme]['quant']} loaded {lm.quant}"
            )  # the default path
            loaded[(name, scheme)] = lm
        return loaded[(name, scheme)]

    get.loaded = loaded
    return get


@pytest.fixture(params=SCHEMES)
def scheme(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def no_cached_blocks(models):
    """Each test starts with nothing cached by the others, so its ``kv_reused_tokens`` are its own."""
    clear_prefix_caches(models.loaded.values())


def text_pipe(lm: LoadedModel, chunk: int | None = None, spec: Speculative | None = None, **engine) -> Pipeline:
    return Pipeline(
        lm,
        {"tokenize": Tokenize(), "prefill": Prefill(chunk_size=chunk), "decode": DecodeLoop(speculative=spec)},
        **engine,
    )


def vl_pipe(lm: LoadedModel, **engine) -> Pipeline:
    return Pipeline(
        lm,
        {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()},
        **engine,
    )


def oracle(lm: LoadedModel, prompt_ids: list[int], n: int = N) -> list[int]:
    """generate()'s greedy tokens after a text prompt, EOS ignored (as the requests here ask)."""
    return generate_oracle(lm, torch.tensor([prompt_ids]), n, ignore_eos=True)


def vl_oracle(lm: LoadedModel, image: Image.Image, text: str, n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, generate() tokens) from the processor's own template on the same message."""
    ids, inputs = image_chat_inputs(lm, [image], text)
    return ids[0].tolist(), generate_oracle(lm, ids, n, ignore_eos=True, **inputs)


def ask(prompt: str, n: int = N, **kw) -> Request:
    return Request(prompt=prompt, max_new_tokens=n, ignore_eos=True, **kw)


# --- the plain answer --------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_text_answer_equals_generate(models, scheme):
    lm = models(TEXT, scheme)
    got = text_pipe(lm, kv_memory=4 << 20).run(ask("Tell me about the sea."))
    assert got.token_ids == oracle(lm, got.prompt_ids)
    assert got.metrics["quant"] == IN_FORCE[scheme]  # what result.json reports


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_image_answer_equals_generate(models, scheme):
    lm = models(VL, scheme)
    image = picture(1)
    got = vl_pipe(lm, kv_memory=8 << 20).run(ask("What is in the picture?", images=[image]))
    prompt_ids, want = vl_oracle(lm, image, "What is in the picture?")
    assert got.prompt_ids == prompt_ids and got.token_ids == want


# --- prefix cache, rollback, fork ----------------------------------------------------------------


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_a_shared_prefix_is_reused_with_the_tokens_of_generate(models, scheme):
    lm = models(TEXT, scheme)
    pipe = text_pipe(lm, kv_memory=8 << 20)
    system = words(random.Random(3), 200)
    first = pipe.run(ask("What is a cloud?", system_prompt=system))
    second = pipe.run(ask("Why is snow white?", system_prompt=system))
    assert first.metrics["kv_reused_tokens"] == 0
    assert second.metrics["kv_reused_tokens"] >= 192  # the 200-word system prompt's full blocks
    assert second.metrics["prefill_tokens"] == second.prompt_tokens - second.metrics["kv_reused_tokens"]
    for result in (first, second):
        assert result.token_ids == oracle(lm, result.prompt_ids)


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_the_same_image_is_found_again_and_another_of_its_size_is_not(models, scheme):
    lm = models(VL, scheme)
    pipe = vl_pipe(lm, kv_memory=8 << 20)
    a, b = picture(10), picture(11)  # same size, other pixels
    first = pipe.run(ask("What is this?", images=[a]))
    other = pipe.run(ask("What is this?", images=[b]))
    image_start = first.prompt_ids.index(lm.config.image_token_id)
    assert other.prompt_ids == first.prompt_ids and other.metrics["kv_reused_tokens"] <= image_start
    again = pipe.run(ask("What is this?", images=[a]))
    assert again.metrics["kv_reused_tokens"] > image_start  # the same pixels: from the prefix cache
    assert again.token_ids == first.token_ids == vl_oracle(lm, a, "What is this?")[1]
    assert other.token_ids == vl_oracle(lm, b, "What is this?")[1]


def run_ids(lm: LoadedModel, ids: list[int], cache: KVCache | None = None, n: int = N):
    """Prefill + decode from raw ids on ``cache`` (or a new one): (tokens, metrics, cache)."""
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=4 << 20)
    ctx = pipe.run_ids(ids, Request(max_new_tokens=n, ignore_eos=True), cache)
    return ctx.generated, ctx.metrics.to_dict(), ctx.cache


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_rollback_and_fork_give_the_tokens_of_generate(models, scheme):
    lm = models(TEXT, scheme)
    prompt = lm.tokenizer("The quick brown fox jumps over the lazy dog, again and again and again.")["input_ids"]
    _, _, cache = run_ids(lm, prompt)
    cache.rollback(len(prompt) - 5)  # back into the prompt
    other = prompt[:-5] + lm.tokenizer(" cats sleep all day")["input_ids"]
    got, metrics, cache = run_ids(lm, other, cache)
    assert metrics["kv_reused_tokens"] == len(prompt) - 5 and got == oracle(lm, other)
    cache.rollback(len(other) - 2)
    assert cache.length % cache.block_size, "the fork needs a partial last block"
    forked = cache.fork()
    tails = [lm.tokenizer(" red roses")["input_ids"], lm.tokenizer(" blue sky")["input_ids"]]
    for c, tail in zip((cache, forked), tails):
        ids = other[:-2] + tail
        got, metrics, _ = run_ids(lm, ids, c)
        assert metrics["kv_reused_tokens"] == len(other) - 2 and got == oracle(lm, ids)


# --- scheduling -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_chunked_prefill_equals_generate(models, scheme):
    lm = models(TEXT, scheme)
    pipe = text_pipe(lm, chunk=7, kv_memory=4 << 20)
    before = pipe.engine.counters["steps"]
    got = pipe.run(ask(words(random.Random(4), 60)))
    assert pipe.engine.counters["steps"] - before >= -(-got.prompt_tokens // 7)  # a forward per 7-token chunk
    assert got.token_ids == oracle(lm, got.prompt_ids)


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_a_batch_preempted_on_a_small_pool_equals_generate(models, scheme):
    lm = models(TEXT, scheme)
    rng = random.Random(5)
    requests = [ask(words(rng, rng.randint(10, 40)), n=rng.randint(6, 14)) for _ in range(12)]
    block = kv_bytes(lm.config, 16, lm.model.dtype)
    pipe = text_pipe(lm, chunk=16, kv_memory=12 * block, max_seqs=12, max_batch_tokens=64)
    before = pipe.engine.counters["preemptions"]
    results = [h.result(timeout=300) for h in [pipe.submit(r) for r in requests]]
    assert pipe.engine.counters["preemptions"] > before, "the pool was meant to force preemption"
    for i, (req, res) in enumerate(zip(requests, results)):
        assert res.token_ids == oracle(lm, res.prompt_ids, req.max_new_tokens), f"request {i}"


# --- speculative decoding -------------------------------------------------------------------------


def test_speculative_decoding_gives_the_tokens_of_plain_greedy(models, scheme):
    """Prompt lookup, a draft model (a noisy held-out copy, loaded the same way) and drafts known
    to be partly right (so accepted drafts and rollbacks both happen): plain greedy's tokens."""
    lm = models(TEXT, scheme)
    plain = text_pipe(lm, kv_memory=4 << 20).run(ask(REPEATING, n=48))  # long enough for lookup to find repeats
    assert plain.token_ids == oracle(lm, plain.prompt_ids, 48)
    specs = {
        "ngram": Speculative("ngram", num_draft=4),
        "draft": Speculative("draft", num_draft=3, draft=models(f"{TEXT}-draft", scheme)),
        "knowing": Knowing(plain.token_ids, plain.prompt_tokens),
    }
    for name, spec in specs.items():
        got = text_pipe(lm, spec=spec, kv_memory=4 << 20).run(ask(REPEATING, n=48))
        assert got.token_ids == plain.token_ids, name
        assert got.metrics["spec_drafted"] > 0, name
    m = got.metrics
    assert 0 < m["spec_accepted"] < m["spec_drafted"], m  # the known drafts: kept and rolled back


# --- constrained output and tools ----------------------------------------------------------------


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_regex_and_json_schema_answers_match(models, scheme):
    lm = models(TEXT, scheme)
    pipe = text_pipe(lm, kv_memory=8 << 20, max_seqs=4)
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    regex = r"\d{3}-[a-z]{2}"
    handles = [
        pipe.submit(Request(prompt="Code?", regex=regex, max_new_tokens=20)),
        pipe.submit(Request(prompt="Trip?", json_schema=schema, max_new_tokens=64)),
    ]
    code, trip = (h.result(timeout=300) for h in handles)
    assert re.fullmatch(regex, code.text) and code.finish_reason == "eos"
    jsonschema.validate(json.loads(trip.text), schema)
    assert trip.finish_reason == "eos"


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_a_required_tool_call_parses(models, scheme):
    lm = models(TEXT, scheme)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    fmt = tool_format(lm.tokenizer.chat_template, lm.tokenizer.get_vocab())
    tag = call_grammar(fmt, tools, "required", parallel=False)
    got = text_pipe(lm, kv_memory=4 << 20).run(
        Request(
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=tools,
            structural_tag=tag,
            max_new_tokens=80,
        )
    )
    (call,) = parse(got.text, fmt, params={"get_weather": params}).calls
    assert call.complete and call.name == "get_weather", got.text
    jsonschema.validate(json.loads(call.arguments), params)


# --- log-probabilities ----------------------------------------------------------------------------


def assert_logprobs(entries, ids: list[int], reference: torch.Tensor, k: int) -> None:
    """Entry j scores ids[j] as reference row j does, with its k best alternatives (within 1e-4,
    as tests/test_logprobs.py)."""
    assert [e.token_id for e in entries] == ids
    for j, e in enumerate(entries):
        assert e.logprob == pytest.approx(float(reference[j, ids[j]]), abs=1e-4)
        values, top = reference[j].topk(k)
        assert [t for t, _ in e.top] == top.tolist()
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_logprobs_equal_a_plain_forward_on_the_same_weights(models, scheme):
    lm = models(TEXT, scheme)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=4 << 20, max_seqs=4)
    ids = list(range(5, 40))
    got = pipe.run_ids(ids, Request(max_new_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3))
    reference = logprob_oracle(lm, ids + got.generated[:-1])
    assert_logprobs(got.logprobs, got.generated, reference[len(ids) - 1 :], 5)
    assert sorted(got.prompt_logprobs) == list(range(1, len(ids)))  # the first position has no score
    assert_logprobs([got.prompt_logprobs[p] for p in range(1, len(ids))], ids[1:], reference[: len(ids) - 1], 3)


# --- the KV cache's own settings ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantised_kv_batches_as_each_request_alone(models, scheme, kind):
    """Quantised keys are not exact against generate(): as tests/test_kv_quantised.py holds, a batch
    and a chunked prefill read the keys as stored, so each answer equals its lone run."""
    lm = models(TEXT, scheme)
    rng = random.Random(6)
    requests = [ask(words(rng, rng.randint(20, 50))) for _ in range(3)]
    batched = [
        h.result(timeout=300)
        for h in [text_pipe(lm, chunk=16, kv_dtype=kind, max_seqs=3, kv_memory=2 << 20).submit(r) for r in requests]
    ]
    alone = text_pipe(lm, kv_dtype=kind, max_seqs=1, kv_memory=3 << 20)
    for req, res in zip(requests, batched):
        assert len(res.token_ids) == N and res.text
        assert res.token_ids == alone.run(req).token_ids


@pytest.mark.parametrize("scheme", WITH_BF16)
def test_the_host_tier_brings_back_evicted_blocks_with_the_tokens_of_generate(models, scheme):
    lm = models(TEXT, scheme)
    pipe = text_pipe(lm, kv_memory=64 * kv_bytes(lm.config, 16, lm.model.dtype), max_seqs=1, kv_offload="host")
    doc = words(random.Random(0), 200) + " What comes next?"
    first = pipe.run(ask(doc))
    for seed in (1, 2):  # other work that needs the whole pool: the document's blocks are evicted
        pipe.run(ask(words(random.Random(seed), 400)))
    before = pipe.engine.stats()
    assert before["kv_tier_stores"] > 0
    again = pipe.run(ask(doc))
    assert pipe.engine.stats()["kv_tier_hits"] - before["kv_tier_hits"] >= 10
    assert again.metrics["kv_reused_tokens"] >= 160
    assert again.token_ids == first.token_ids == oracle(lm, first.prompt_ids)


# --- through the command line, with no quant= given ----------------------------------------------


def turns(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "chat.jsonl").read_text().splitlines()]


def chat_oracle(lm: LoadedModel, messages: list[dict], n: int) -> list[int]:
    ids = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    return generate_oracle(lm, ids, n)


def test_chat_undo_in_the_repl(models, tmp_path):
    """mode=chat's REPL on the default weights (in this process: the CLI's own import costs ~15 s;
    tests/test_chat.py runs the REPL through the CLI)."""
    lm = models(TEXT, "int8wo")
    chat = ChatSession(text_pipe(lm, kv_memory=8 << 20), max_new_tokens=N, log_path=tmp_path / "chat.jsonl")
    out = io.StringIO()
    Repl(
        chat,
        stdin=io.StringIO("Hi there.\n/undo\nTell me about the sea.\nAnd the sky?\n"),
        stdout=out,
        stderr=io.StringIO(),
    ).loop()
    log = turns(tmp_path)
    assert [(r["event"], r["turn"]) for r in log] == [("turn", 1), ("undo", 1), ("turn", 1), ("turn", 2)]
    first, second = log[2:]
    assert {first["metrics"]["quant"], second["metrics"]["quant"]} == {"int8wo"}
    history = [{"role": "user", "content": "Tell me about the sea."}]
    assert first["token_ids"] == chat_oracle(lm, history, N)
    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And the sky?"}]
    assert second["token_ids"] == chat_oracle(lm, history, N)
    assert second["metrics"]["kv_reused_tokens"] > 0
    assert len(out.getvalue().splitlines()) == 3  # three answers streamed, the undone one included


def test_an_interrupted_batch_resumes_on_the_default_weights(held_out, models, tmp_path, monkeypatch):
    lm = models(TEXT, "int8wo")
    prompts = ["Tell me about the sea.", "Count to five.", "Why?", "Say something."]
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": i, "prompt": q, "ignore_eos": True}) + "\n" for i, q in enumerate(prompts)))
    out, model = tmp_path / "out", f"model.path={held_out(TEXT)}"
    proc = run_cli(
        "mode=batch",
        f"input={p}",
        model,
        "max_new_tokens=6",
        "batch.progress=false",
        f"hydra.run.dir={out}",
        env={batch.EXIT_AFTER_ENV: "2"},
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    done = [json.loads(line) for line in (out / "results.part0.jsonl").read_text().splitlines()]
    assert [r["id"] for r in done] == [0, 1]
    run_batch(monkeypatch, out, f"input={p}", model)  # the resume, in this process: max_new_tokens=6 too
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [0, 1, 2, 3] and records[:2] == done
    assert json.loads((out / "summary.json").read_text())["quant"] == "int8wo"
    for r, q in zip(records, prompts):
        assert r["token_ids"] == oracle(lm, prompt_ids(lm, q), 6), r["id"]


def test_serve_answers_the_openai_client_on_the_default_weights(held_out, models, tmp_path):
    lm = models(TEXT, "int8wo")
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    alone = text_pipe(lm, kv_memory=4 << 20).run(Request(messages=messages, max_new_tokens=N, ignore_eos=True))
    assert alone.token_ids == oracle(lm, alone.prompt_ids)
    with serving(tmp_path, f"model.path={held_out(TEXT)}", "kv.memory=16000000", "serve.model_name=held-out") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(
            model="held-out", messages=messages, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        assert "weights (quant=int8wo): quant=auto chose int8wo on CPU" in server.stderr()
    assert got.choices[0].message.content == alone.text
    assert got.usage.completion_tokens == N and got.usage.prompt_tokens == alone.prompt_tokens
    full = text_pipe(models(TEXT, "none"), kv_memory=4 << 20).run(
        Request(messages=messages, max_new_tokens=N, ignore_eos=True)
    )
    assert full.text != alone.text, "the prompt was chosen so that int8wo and float32 answer differently"
