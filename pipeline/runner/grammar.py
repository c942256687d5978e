"""Constrained decoding (structured outputs) with xgrammar: output valid by construction.

A request's constraint (``Request.json_schema``, ``regex``, ``choice``, ``grammar`` or
``structural_tag``, which the server uses for tool calls) is checked and turned into an xgrammar
``Grammar`` when the request is submitted, so bad input fails at once; it is compiled for the
model's vocabulary on a worker thread, so a large schema never stalls the engine's step (the
sequence waits in the queue meanwhile); compiled grammars are cached by xgrammar (bounded by
bytes), so a second request with the same spec pays nothing. Each sequence has its own matcher:
every step, the allowed tokens of all constrained rows go into one bitmask, applied in one call
(unconstrained rows are not touched).

Thinking models: when the tokenizer has ``<think>``/``</think>`` and the request asks for thinking
(``Request.thinking=True``), a reasoning block may come first, unconstrained; the constraint holds
for the answer. Otherwise the answer starts at once (a random or weak model would never stop
"thinking").

Why xgrammar: the reference backend of vLLM and SGLang, CPU and GPU, token bitmasks in C++,
matcher rollback (speculative decoding), and per-model tool-call formats (structural tags).
It is imported on the first constrained request (importing it costs seconds).
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pipeline.errors import UserError

FIELDS = ("json_schema", "regex", "choice", "grammar", "structural_tag")  # Request fields, at most one set
THINK = ("<think>", "</think>")
CACHE_BYTES = 512 << 20  # compiled grammars kept (xgrammar's own cache, least recently used out)

# JSON Schema keywords the grammar enforces (or that only annotate). Anything else is refused:
# a keyword silently ignored would let through output the schema forbids.
SCHEMA_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "nullable",
        "strict",
    }
)
SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})  # name -> schema
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})  # [schema]
SCHEMA_ONE = frozenset({"items", "additionalProperties", "propertyNames"})  # schema (or a bool)
_xgr: Any = None


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` (one of ``FIELDS``) and ``spec`` as text (the
    compile key), whether a reasoning block may come first (``think``), and the xgrammar
    ``Grammar`` built from them when the request was checked (compiled from there)."""

    kind: str
    spec: str
    think: bool = False
    grammar: Any = field(default=None, compare=False, repr=False)


def xgrammar() -> Any:
    global _xgr
    if _xgr is None:
        try:
            import xgrammar as module  # lazily: seconds to import, needed only by constrained requests
        except ImportError:
            raise UserError("constrained decoding needs xgrammar: pip install xgrammar") from None
        _xgr = module
    return _xgr


def requested(request: Any) -> list[str]:
    """The constraint fields the request sets (more than one is an error, in ``constraint_of``)."""
    return [name for name in FIELDS if getattr(request, name, None) is not None]


def constraint_of(request: Any, think: bool) -> Constraint | None:
    """The request's constraint, checked (None: unconstrained). ``think``: the model can reason
    first (its tokenizer has the think tags and the request leaves thinking on)."""
    given = requested(request)
    if not given:
        return None
    if len(given) > 1:
        raise UserError(f"a request takes one output constraint, got {' and '.join(given)}")
    kind = given[0]
    spec = _spec(kind, getattr(request, kind))
    return Constraint(kind, spec, think, answer_grammar(kind, spec, think))  # errors now, in the caller's thread


def _spec(kind: str, value: Any) -> str:
    if kind in ("json_schema", "structural_tag"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise UserError(f"{kind} is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise UserError(f"{kind} must be a JSON object, got {type(value).__name__}")
        if kind == "json_schema":
            check_schema(value)
        return json.dumps(value, ensure_ascii=False)
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise UserError("choice must be a non-empty list of non-empty strings")
        return json.dumps(list(value), ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise UserError(f"{kind} must be a non-empty string")
    return value


def check_schema(schema: Any, where: str = "json_schema") -> None:
    """Refuse a keyword the grammar would not enforce, naming where it is."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise UserError(f"{where} must be a JSON Schema object, got {json.dumps(schema)[:60]}")
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            raise UserError(f"{where}: the JSON Schema keyword {key!r} is not supported by constrained decoding")
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{where}.{key}.{name}")
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}.{key}[{i}]")
        elif key in SCHEMA_ONE:
            check_schema(value, f"{where}.{key}")


def plain_bounded_strings(schema: Any) -> Any:
    """The schema with each string's ``minLength``/``maxLength`` (and no ``pattern``, ``format``,
    ``enum`` or ``const``) written as a ``pattern`` of that many characters that need no escape.
    Why: xgrammar 0.2.8 writes a length-bounded string as ``[^"\\\r\n]{m,n}``, which admits raw
    control characters (a tab, \x18): invalid JSON. Its pattern strings exclude them; the pattern
    also excludes the UTF-16 surrogates, whose 3-byte forms xgrammar's classes admit (ill-formed
    UTF-8: each byte decodes to U+FFFD, three characters where the grammar counted one)."""
    if isinstance(schema, list):
        return [plain_bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: plain_bounded_strings(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if bounded and out.get("type") == "string" and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = "^[^\\x00-\\x1f\\ud800-\\udfff]{%d,%s}$" % (low, "" if high is None else int(high))
    return out


def answer_grammar(kind: str, spec: str, think: bool) -> Any:
    """The xgrammar ``Grammar`` of the answer (with an optional reasoning block first when ``think``)."""
    xgr = xgrammar()
    try:
        if kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(plain_bounded_strings(json.loads(spec)), any_whitespace=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            grammar = xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(s) for s in json.loads(spec)))
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(spec)
        else:
            grammar = xgr.Grammar.from_structural_tag(spec)
    except Exception as err:  # xgrammar raises RuntimeError / ValueError / its own errors with a message
        raise UserError(f"{kind}: {_message(err)}") from None
    if not think:
        return grammar
    return xgr.Grammar.concat(_reasoning_block(xgr), grammar)


def _reasoning_block(xgr: Any) -> Any:
    """An optional ``<think>...</think>`` then a blank line (the Qwen templates' shape)."""
    st = xgr.structural_tag
    block = st.SequenceFormat(
        elements=[
            st.TagFormat(begin=THINK[0], content=st.AnyTextFormat(excludes=list(THINK)), end=THINK[1]),
            st.ConstStringFormat(value="\n\n"),
        ]
    )
    return xgr.Grammar.from_structural_tag(st.StructuralTag(format=st.OptionalFormat(content=block)))


def _ebnf_string(text: str) -> str:
    """A literal for xgrammar's EBNF (C-style escapes inside double quotes)."""
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    )
    return f'"{escaped}"'


def _message(err: BaseException) -> str:
    """xgrammar's message without its timestamp and source location."""
    text = str(err).strip()
    return re.sub(r"^\[[\d:]+\] \S+?:\d+: ", "", text) or type(err).__name__


def think_ids(tokenizer: Any) -> list[int] | None:
    """The ids of ``<think>`` and ``</think>`` (None: the model has no think tags)."""
    vocab = tokenizer.get_vocab()
    return [vocab[tag] for tag in THINK] if all(tag in vocab for tag in THINK) else None


class Grammars:
    """One model's compiler: compiles on one worker thread, shares a compile in flight between
    requests with the same constraint; xgrammar's cache keeps the compiled ones."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._inflight: dict[Constraint, Future] = {}
        self._lock = threading.Lock()
        self.think_ids = think_ids(tokenizer)
        # Figures (Engine.stats): time spent compiling, and masking + accepting on the step.
        self.compiles, self.compile_s, self.masks, self.step_s = 0, 0.0, 0, 0.0

    def compile(self, c: Constraint) -> Future:
        """The compiled grammar of ``c``, as a future."""
        with self._lock:
            future = self._inflight.get(c)
            if future is not None:
                return future
            future = self._inflight[c] = self._pool.submit(self._compile, c)
        # Outside the lock: a compile already done (xgrammar's cache) runs the callback here, at once.
        future.add_done_callback(lambda _: self._forget(c))
        return future

    def _forget(self, c: Constraint) -> None:
        with self._lock:
            self._inflight.pop(c, None)

    def _compile(self, c: Constraint) -> Any:
        xgr = xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
        t0 = time.perf_counter()
        try:
            return self._compiler.compile_grammar(c.grammar)
        except Exception as err:
            raise UserError(f"{c.kind}: {_message(err)}") from None
        finally:
            self.compiles, self.compile_s = self.compiles + 1, self.compile_s + time.perf_counter() - t0

    def open(self, c: Constraint) -> "Matcher":
        return Matcher(self.compile(c), c, self.think_ids, self)


class Matcher:
    """One sequence's place in its grammar. Created at submission (compiling); ``start`` once the
    prompt is known (a prompt that ends inside an open ``<think>`` continues that block)."""

    def __init__(
        self, compiled: Future, constraint: Constraint, think_ids: list[int] | None, owner: Grammars | None = None
    ) -> None:
        self.compiled, self.constraint, self.think_ids, self.owner = compiled, constraint, think_ids, owner
        self.matcher: Any = None
        self.seconds = 0.0  # this sequence's share of masking and accepting (its "grammar_s" metric)

    def charge(self, seconds: float) -> None:
        self.seconds += seconds
        if self.owner is not None:
            self.owner.step_s += seconds

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Raises the compile error (``UserError``) if compiling failed."""
        if self.matcher is not None:
            return  # readmitted after a preemption: the matcher already holds the generated tokens
        self.matcher = xgrammar().GrammarMatcher(self.compiled.result())
        if self.constraint.think and self.think_ids and inside_think(prompt_ids, *self.think_ids):
            self.matcher.accept_string(THINK[0])

    def accept(self, token_id: int) -> None:
        t0 = time.perf_counter()
        taken = self.matcher.accept_token(int(token_id))
        self.charge(time.perf_counter() - t0)
        if not taken:
            raise RuntimeError(f"the {self.constraint.kind} constraint rejected token {token_id}")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` the grammar takes in a row (stopping before one that ends it);
        the matcher is left where it was."""
        n = 0
        for token in drafts:
            if not self.matcher.accept_token(int(token)):
                break
            n += 1
            if self.matcher.is_terminated():
                self.matcher.rollback(1)
                n -= 1
                break
        if n:
            self.matcher.rollback(n)
        return n


def inside_think(ids: Sequence[int], start: int, end: int) -> bool:
    """The prompt's last think tag opens a block (the template started the reasoning)."""
    for token in reversed(ids):
        if token == start:
            return True
        if token == end:
            return False
    return False


def mask(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """Every constrained row's disallowed tokens to -inf, in one bitmask and one call; returns
    ``logits`` itself when no row is constrained, else a float32 copy."""
    rows = [(i, m, ()) for i, m in enumerate(matchers) if m is not None]
    return mask_rows(logits, rows) if rows else logits


def mask_rows(logits: torch.Tensor, rows: Sequence[tuple[int, Matcher, Sequence[int]]]) -> torch.Tensor:
    """``rows``: (row of ``logits``, its matcher, the tokens between the matcher's state and that
    row: drafts, taken for the row and given back after). Returns a float32 copy."""
    t0, xgr = time.perf_counter(), xgrammar()
    out = logits.float().clone()
    bitmask = xgr.allocate_token_bitmask(out.shape[0], out.shape[-1])
    for row, m, ahead in rows:
        for token in ahead:
            m.matcher.accept_token(int(token))
        m.matcher.fill_next_token_bitmask(bitmask, row)
        if ahead:
            m.matcher.rollback(len(ahead))
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=[row for row, _, _ in rows])
    share = (time.perf_counter() - t0) / len(rows)  # on a GPU: host time (the apply is queued, not waited for)
    for _, m, _ in rows:
        m.charge(share)
    if rows[0][1].owner is not None:
        rows[0][1].owner.masks += 1
    return out
