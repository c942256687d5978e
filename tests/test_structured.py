"""Constrained decoding (``Request.json_schema / regex / choice / grammar``): on tiny random-weight
models, which would never write JSON by themselves, every output parses and validates; it composes
with batching (unconstrained rows keep their solo tokens), preemption, speculative decoding and
seeded sampling; bad constraints fail in one line naming the problem."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from pipeline import Pipeline, Request, UserError
from pipeline.memory import kv_bytes
from pipeline.runner import grammar
from pipeline.spec import Speculative
from stages import DecodeLoop, Prefill, Sampler, Tokenize
from structured_schemas import schemas


def pipe_for(lm, kv_memory: int = 64 << 20, max_seqs: int = 50, **decode) -> Pipeline:
    return Pipeline(
        lm,
        {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(**decode)},
        kv_memory=kv_memory,
        max_seqs=max_seqs,
    )


def run_all(pipe: Pipeline, requests: list[Request]) -> list:
    handles = [pipe.submit(r) for r in requests]
    return [h.result() for h in handles]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fifty_schemas_batched_every_output_validates(load_tiny, family):
    cases = schemas(50)
    results = run_all(
        pipe_for(load_tiny(family)),
        [Request(prompt=f"Item {i}", json_schema=s, max_new_tokens=256) for i, s in enumerate(cases)],
    )
    for schema, result in zip(cases, results):
        assert result.finish_reason == "eos", result.text
        jsonschema.validate(json.loads(result.text), schema)


def test_regex_choice_grammar_and_any_object(load_tiny):
    pipe = pipe_for(load_tiny("qwen3"))
    before = pipe.engine.stats().get("grammar_compiles", 0)  # the engine may have served other tests
    regex, choice = r"\d{3}-[a-z]{2}", ["red", "green", 'blue "sky"']
    ebnf = 'root ::= "yes" | "no" | ("maybe " [0-9])'
    got = run_all(
        pipe,
        [
            Request(prompt="Code?", regex=regex, max_new_tokens=20),
            Request(prompt="Colour?", choice=choice, max_new_tokens=20),
            Request(prompt="Well?", grammar=ebnf, max_new_tokens=20),
            Request(prompt="Small", json_schema='{"type": "object", "maxProperties": 0}', max_new_tokens=8),
        ],
    )
    assert re.fullmatch(regex, got[0].text)
    assert got[1].text in choice
    assert re.fullmatch(r"yes|no|maybe [0-9]", got[2].text)
    assert json.loads(got[3].text) == {}
    assert all(r.finish_reason == "eos" for r in got)
    assert all(r.metrics["grammar_s"] > 0 for r in got)  # each request's share of the grammar's step time
    stats = pipe.engine.stats()
    assert stats["grammar_compiles"] - before == 4 and stats["grammar_masks"] >= max(len(r.token_ids) for r in got)
    pipe.run(Request(prompt="Again", regex=regex, max_new_tokens=20))
    assert pipe.engine.stats()["grammar_compiles"] - before == 5  # a compile call, answered by xgrammar's cache


def test_unconstrained_rows_keep_their_solo_tokens_and_seeded_sampling_is_batch_invariant(load_tiny):
    lm = load_tiny("qwen3")
    pipe = pipe_for(lm)
    plain = [Request(prompt=p, max_new_tokens=24) for p in ("Hello there", "What is a cat?")]
    solo = [pipe.run(r).token_ids for r in plain]
    seeded = Request(
        prompt="Pick", choice=["alpha", "beta", "gamma", "delta"], sampler=Sampler(temperature=1.0, seed=5)
    )
    alone = pipe.run(seeded).text
    mixed = run_all(
        pipe, [plain[0], Request(prompt="JSON", json_schema=schemas(1)[0], max_new_tokens=64), seeded, plain[1]]
    )
    assert [mixed[0].token_ids, mixed[3].token_ids] == solo
    assert mixed[2].text == alone


def test_preempted_constrained_sequences_end_as_they_would_alone(load_tiny):
    lm = load_tiny("qwen3")
    cases = schemas(12, seed=1)
    requests = [Request(prompt=f"Record {i}", json_schema=s, max_new_tokens=128) for i, s in enumerate(cases)]
    alone = [pipe_for(lm).run(r).token_ids for r in requests]
    small = pipe_for(lm, kv_memory=30 * kv_bytes(lm.config, 16, lm.model.dtype), max_seqs=12)  # preemption
    before = small.engine.counters["preemptions"]
    got = run_all(small, requests)
    assert small.engine.counters["preemptions"] > before, "the pool was meant to force preemption"
    assert [r.token_ids for r in got] == alone
    finished = [(schema, r) for schema, r in zip(cases, got) if r.finish_reason == "eos"]
    assert len(finished) >= 9
    for schema, result in finished:
        jsonschema.validate(json.loads(result.text), schema)


def test_speculative_decoding_with_a_constraint_gives_the_plain_tokens(load_tiny):
    lm = load_tiny("qwen3")
    cases = schemas(6, seed=2)
    requests = [
        Request(prompt="the cat sat on the mat; the cat sat on", json_schema=s, max_new_tokens=128) for s in cases
    ]
    plain = run_all(pipe_for(lm), requests)
    spec_pipe = pipe_for(lm, speculative=Speculative("ngram", num_draft=4))
    speculative = run_all(spec_pipe, requests)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert sum(r.metrics.get("spec_drafted", 0) for r in speculative) > 0


def test_a_constrained_answer_cut_by_max_new_tokens_says_length(load_tiny):
    result = pipe_for(load_tiny("qwen3")).run(
        Request(
            prompt="x",
            json_schema={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
            max_new_tokens=12,
        )
    )
    assert result.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(json_schema={"type": "objec"}), 'json_schema: Unsupported type "objec"'),
        (dict(json_schema={"type": "integer", "multipleOf": 3}), "keyword 'multipleOf' is not supported"),
        (
            dict(json_schema={"type": "object", "properties": {"a": {"not": {}}}}),
            "json_schema.properties.a: the JSON Schema keyword 'not'",
        ),
        (dict(json_schema="{bad"), "json_schema is not valid JSON"),
        (dict(regex="a(b"), "regex: Regex parsing error at position 4"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(grammar="root ::= "), "grammar: EBNF parser error"),
        (dict(regex="a", choice=["x"]), "one output constraint, got regex and choice"),
    ],
)
def test_bad_constraints_fail_at_submit_naming_the_problem(load_tiny, kwargs, message):
    pipe = pipe_for(load_tiny("qwen3"))
    with pytest.raises(UserError, match=re.escape(message)):
        pipe.submit(Request(prompt="x", **kwargs))
    assert pipe.run(Request(prompt="x", max_new_tokens=4)).finish_reason in ("length", "eos")  # the engine goes on


def test_a_thinking_request_reasons_freely_then_answers_in_the_schema(load_tiny):
    """thinking=True: a ``<think>`` block first (here steered by a logits hook, as a real model
    would write it), unconstrained; then the schema holds for the answer."""
    lm = load_tiny("qwen3")
    tok = lm.tokenizer
    script = [tok.convert_tokens_to_ids("<think>"), *tok.encode(" hmm"), tok.convert_tokens_to_ids("</think>")]

    class Steered(DecodeLoop):
        def process_logits(self, logits, contexts):
            for row, ctx in enumerate(contexts):
                step = len(ctx.generated)
                if step < len(script):
                    logits[row, script[step]] += 1e4
            return logits

    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": Steered()}, kv_memory=16 << 20)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    result = pipe.run(Request(prompt="n?", json_schema=schema, thinking=True, max_new_tokens=64))
    assert result.token_ids[: len(script)] == script
    reasoning, answer = result.text.split("</think>")
    assert reasoning == "<think> hmm"
    jsonschema.validate(json.loads(answer), schema)
    # thinking not asked for: the steered <think> is refused, the answer starts at once
    direct = pipe.run(Request(prompt="n?", json_schema=schema, max_new_tokens=64))
    jsonschema.validate(json.loads(direct.text), schema)


def test_length_bounded_strings_hold_only_characters_json_and_utf8_allow():
    """xgrammar's own rule for them admits a raw tab, and its classes the ill-formed 3-byte forms of
    UTF-16 surrogates: neither may follow in a bounded string (a plain one takes what it would)."""
    from pipeline.testing import make_tokenizer

    tok = make_tokenizer("qwen3")
    grammars = grammar.Grammars(tok, len(tok), [tok.eos_token_id])
    vocab = tok.get_vocab()
    tab, ed, b4, ninety = vocab["ĉ"], vocab["í"], vocab["´"], vocab["Ĥ"]  # bytes 09, ED, B4, 82

    def after_quote(string: dict) -> object:
        schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
        m = grammars.open(grammar.constraint_of(Request(json_schema=schema), False))
        m.start([])
        for token in tok.encode('{"s": "', add_special_tokens=False):
            m.accept(token)
        return m.matcher

    bounded = after_quote({"type": "string", "minLength": 1, "maxLength": 4})
    assert not bounded.accept_token(tab)
    assert bounded.accept_token(ed) and not bounded.accept_token(b4)  # ED B4 ..: a surrogate
    assert bounded.accept_token(ninety)  # ED 82 ..: U+D0xx, a real character, goes on
    plain = after_quote({"type": "string"})
    assert plain.accept_token(ed) and plain.accept_token(b4)  # unbounded strings: xgrammar's rule, unchanged


def test_batch_lines_and_cli_settings_become_constraints(tmp_path):
    """A JSONL line's response_format replaces the run's decode.json_schema; bad ones name the line."""
    from test_batch import compose_cfg

    from pipeline.cli.assemble import request_from_cfg
    from pipeline.modes import batch

    (tmp_path / "s.json").write_text('{"type": "object", "properties": {"n": {"type": "integer"}}}')
    lines = [
        {"id": 1, "prompt": "a"},
        {"id": 2, "prompt": "b", "response_format": {"type": "json_object"}},
        {
            "id": 3,
            "prompt": "c",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [1]}}},
        },
    ]
    items = tmp_path / "items.jsonl"
    items.write_text("\n".join(json.dumps(line) for line in lines))
    cfg = compose_cfg("mode=batch", f"decode.json_schema={tmp_path / 's.json'}", "prompt=x")
    requests = [batch.item_request(cfg, item) for item in batch.read_items(items)]
    assert [r.json_schema for r in requests] == [
        '{"type": "object", "properties": {"n": {"type": "integer"}}}',
        {"type": "object"},
        {"enum": [1]},
    ]
    assert request_from_cfg(compose_cfg("decode.choice=[yes,no]", "prompt=x")).choice == ["yes", "no"]
    items.write_text(json.dumps({"id": 1, "prompt": "a", "response_format": {"type": "json_schema"}}))
    with pytest.raises(UserError, match="line 1: response_format.json_schema must be an object"):
        batch.read_items(items)
    with pytest.raises(UserError, match="regex: Regex parsing error"):
        request_from_cfg(compose_cfg("decode.regex='a(b'", "prompt=x"))


def test_every_chat_turn_is_held_to_the_schema_and_undo_composes(load_tiny, tiny_dir, tmp_path):
    """ChatSession(constraint=...) (and mode=chat decode.json_schema=...): each answer validates;
    after /undo (the cache rolled back) the next turn equals a fresh session's."""
    from conftest import run_cli

    from pipeline.frontends.chat_session import ChatSession

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "tag": {"enum": ["a", "b"]}},
        "required": ["n", "tag"],
    }
    pipe = pipe_for(load_tiny("qwen3"))
    chat = ChatSession(pipe, max_new_tokens=64, constraint={"json_schema": schema})
    for text in ("First?", "Second?", "Third?"):
        jsonschema.validate(json.loads(chat.send(text).text), schema)
    chat.undo()
    again = chat.send("Other?")
    fresh = ChatSession(pipe_for(load_tiny("qwen3")), max_new_tokens=64, constraint={"json_schema": schema})
    expected = [fresh.send(text) for text in ("First?", "Second?", "Other?")][-1]
    assert again.token_ids == expected.token_ids and again.metrics["kv_reused_tokens"] > 0
    proc = run_cli(
        "mode=chat",
        f"model.path={tiny_dir('qwen3')}",
        "max_new_tokens=64",
        f"hydra.run.dir={tmp_path}",
        "decode.choice=[yes,no]",
        input="Well?\nAnd now?\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() and set(proc.stdout.split()) <= {"yes", "no"}


def test_a_compile_that_is_done_at_once_does_not_deadlock(monkeypatch):
    """A grammar xgrammar has cached compiles before ``add_done_callback`` is reached, which then
    runs the callback in the calling thread: it must not need the lock that thread holds (this hung
    the suite once). Forced here: the worker pool hands back an already finished future."""
    from concurrent.futures import Future

    from pipeline.testing import make_tokenizer

    tok = make_tokenizer("qwen3")
    grammars = grammar.Grammars(tok, len(tok), [tok.eos_token_id])

    def done_at_once(fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future

    monkeypatch.setattr(grammars._pool, "submit", done_at_once)
    c = grammar.constraint_of(Request(choice=["yes", "no"]), False)
    out = []
    worker = threading.Thread(target=lambda: out.append(grammars.compile(c).result()), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert out and not worker.is_alive()
    assert c not in grammars._inflight  # forgotten once done: the next request compiles (from the cache)
