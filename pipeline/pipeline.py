"""Pipeline: the stages of one inference, run for many requests at once by one engine."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import torch

from pipeline.model import tensor_parallel
from pipeline.context import Context, Request, Result
from pipeline.engine import Engine, Handle, Phases, Sequence as EngineSequence
from pipeline.errors import UserError
from pipeline.engine.headroom import measured_headroom
from pipeline.engine.pooling import embedding
from pipeline.kv import ATTENTION, BlockPool, KVCache
from pipeline.kv.offload import Offload, attach_tier
from pipeline.kv.quantised import kv_format
from pipeline.kv.sizing import Pools, pools_for
from pipeline.model.loading import LoadedModel
from pipeline.model.lora import Adapter
from pipeline.metrics import Metrics, decode_weight_bytes, reset_window, synchronize
from pipeline.runner import CompiledStep, GraphedStep, ModelRunner, mirror
from pipeline.sampling import fork_sampler

Stage = Callable[[Context], Any]
ENGINE_STAGES = {"prefill": "stages.Prefill", "decode": "stages.DecodeLoop"}  # run by the engine, through hooks


_SHARED_LOCK = threading.RLock()  # re-entered: sizing a pool runs a scratch pipeline (pipeline.engine.headroom)


def _shared(lm: LoadedModel, key: tuple, make: Callable[[], Any]) -> Any:
    """One object per loaded model and key (pools, engines), kept on the model object."""
    with _SHARED_LOCK:
        table = lm.__dict__.setdefault("_mm_shared", {})
        if key not in table:
            table[key] = make()
        return table[key]


def follow(lm: LoadedModel) -> None:
    """Ranks 1..N-1 of a tensor-parallel launch (``load_model(..., tp=N)`` under torchrun): run
    rank 0's model steps on this rank's shard until rank 0 calls ``tensor_parallel.finish()``.
    Rank 0 builds its ``Pipeline`` as usual; nothing but the model runs here."""
    group = tensor_parallel.current()
    if group is None or group.driver:
        raise UserError(
            "follow() is for ranks 1..N-1 of a tensor-parallel launch (load_model(..., tp=N) under torchrun)"
        )
    mirror.follow(lm, group, ModelRunner)
    tensor_parallel.finish()


def shared_engine(
    lm: LoadedModel,
    pool: BlockPool,
    compiled: CompiledStep | GraphedStep | None = None,
    *,
    max_seqs: int = 8,
    max_batch_tokens: int = 2048,
    burst: int = 8,
    matvec: bool = True,
) -> Engine:
    """The engine (and its model runner) for this model, pool, fixed-shape step, limits and kernel
    choice (``matvec``: ``ModelRunner``'s ``native``): one per combination, shared by every
    pipeline and hand-driven stage that asks for it."""
    key = ("engine", id(pool), id(compiled), max_seqs, max_batch_tokens, burst, matvec)

    def make() -> Engine:
        runner = ModelRunner(lm, pool, compiled, native=matvec)
        engine = Engine(runner, max_seqs=max_seqs, max_batch_tokens=max_batch_tokens, burst=burst)
        reset_window(engine.device)  # its first step's peak memory is not the weights' loading peak
        return engine

    return _shared(lm, key, make)


def check_stages(stages: Mapping[str, Any]) -> None:
    """Refuse, in one line, an engine phase the engine could not honour: ``prefill`` and
    ``decode`` run batched through their hooks, so they must be the stages' own classes (or
    subclasses that override hooks, not ``__call__``)."""
    for name, base in ENGINE_STAGES.items():
        stage = stages.get(name)
        if stage is None:
            continue
        check = getattr(stage, "check_phase", None)
        if check is None:
            raise UserError(
                f"stages.{name}: {type(stage).__name__} is not a {base}: the engine runs {name} for many "
                f"requests at once through a {base}'s hooks; subclass {base} and override those"
            )
        check(name)


REMOVED = {  # 0.1's keywords -> what replaced them
    "kv_static": "the KV cache is a paged pool now: drop kv_static",
    "kv_max_len": "the pool is sized in bytes: pass kv_memory= (bytes, a fraction of free memory, or 'auto')",
}


def refuse_removed(kwargs: Mapping[str, Any]) -> None:
    """A keyword 0.1 took is refused with what to use instead (any other is a plain TypeError)."""
    for name in kwargs:
        if name in REMOVED:
            raise TypeError(f"Pipeline({name}=...) was removed in 0.2: {REMOVED[name]}")
        raise TypeError(f"Pipeline() got an unexpected keyword argument {name!r}")


def default_max_seqs(device: torch.device | str) -> int:
    """Sequences in flight by default: 32 on a GPU, 8 on a CPU."""
    return 32 if torch.device(device).type == "cuda" else 8


class Pipeline:
    """An ordered, named chain of stages. Names become metric keys (``stages.<name>.seconds``).

    Stages before ``prefill`` (tokenize, the media encoders, your own) run once per request
    when the engine admits it; ``prefill`` and ``decode`` are engine phases, run batched with
    other requests through their hooks (``Prefill.plan_chunk``; ``DecodeLoop.process_logits``,
    ``on_token`` and its sampler; see ``stages``); stages after ``decode`` run when the request
    ends. A stage may define ``skip(ctx) -> bool``; skipped stages record nothing.

    Every run goes through one engine (``pipeline.engine``), so any number of threads may call
    ``run`` at once and each gets the answer it would get alone; the waiting threads take turns
    stepping it. ``kv_memory`` / ``kv_block_size`` (and, for models with linear-attention layers,
    ``kv_state_checkpoint_every``) size the paged KV pool (``pipeline.kv.pool_for``); ``kv_dtype`` is how it
    stores keys and values (``auto``: the model's dtype; ``int8``, ``fp8``: ``pipeline.kv.quantised``);
    ``kv_offload`` (``none``, ``host``, ``disk``, with ``kv_offload_bytes`` / ``kv_offload_dir``) keeps blocks
    the pool evicts in a second tier (``pipeline.kv.tier``); ``kv_attention`` is how
    attention reads it (``auto``, ``flex``, ``sdpa``: ``pipeline.runner.flex``); ``max_seqs`` / ``max_batch_tokens``
    bound the engine's batches; ``burst``: greedy decode steps run back to back (``Engine``).
    """

    def __init__(
        self,
        lm: LoadedModel,
        stages: Mapping[str, Stage],
        *,
        kv_memory: float | int | str | None = None,
        kv_block_size: int = 16,
        kv_state_checkpoint_every: int = 1024,
        kv_attention: str = "auto",
        kv_dtype: str = "auto",
        kv_offload: str = "none",
        kv_offload_bytes: int | None = None,
        kv_offload_dir: str | None = None,
        max_seqs: int | None = None,
        max_batch_tokens: int = 2048,
        burst: int = 8,
        **removed: Any,
    ) -> None:
        refuse_removed(removed)
        self.lm = lm
        self.stages = dict(stages)
        check_stages(self.stages)
        self.kv_memory = kv_memory
        self.kv_block_size = kv_block_size
        self.kv_state_checkpoint_every = kv_state_checkpoint_every
        if kv_attention not in ATTENTION:
            raise UserError(f"kv_attention must be one of {', '.join(ATTENTION)} (got {kv_attention!r})")
        self.kv_attention = kv_attention
        kv_format(kv_dtype)  # refuses an unknown one now
        self.kv_dtype = kv_dtype
        self.kv_offload = Offload.checked(kv_offload, kv_offload_bytes, kv_offload_dir)
        self.max_seqs = max_seqs if max_seqs is not None else default_max_seqs(lm.device)
        self.max_batch_tokens = max_batch_tokens
        self.burst = burst
        self.warmup_s: float | None = None  # time spent in warmup(), reported apart from ttft_s
        self._pool: BlockPool | None = None
        self._pools: Pools | None = None  # the pool, a draft model's sized with it, and their budget
        self._engine: Engine | None = None
        self._decode_weights: int | None = None  # bytes a decode step reads (metrics.decode_weight_bytes)
        self.compile_on_submit = True  # compile="auto": the first request starts compile_ahead()

    # --- the shared pool and engine -----------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        """The model's KV pool for these settings: pipelines on one model with the same ``kv_memory``
        and ``kv_block_size`` share it, and so share its prefix cache."""
        if self._pool is None:
            self._pool = self.pools.pools[0]
        return self._pool

    @property
    def pools(self) -> Pools:
        """The pool, the draft model's pool when it was sized with it, and the budget they came
        from (``Pools.describe()``: the line ``mode=run`` reports)."""
        if self._pools is None:
            self._pools = self._shared_pools()
        return self._pools

    def _shared_pools(self) -> Pools:
        """Sized on first use, once per model and settings. A draft model (``decode.speculative=draft``)
        without a memory setting of its own gets its pool from the same budget
        (``pipeline.kv.pools_for``), handed to its ``Speculative``."""
        key = ("pool", self.kv_memory, self.kv_block_size, self.kv_attention, self.kv_dtype, self.kv_offload)
        if getattr(self.lm, "recurrent", False):  # the state slots depend on these too
            key += (self.kv_state_checkpoint_every, self.max_seqs)
        spec = getattr(self.stages.get("decode"), "speculative", None)
        joint = spec if spec is not None and getattr(spec, "shares_budget", False) else None
        models = [self.lm] + ([joint.draft] if joint is not None else [])
        pools = _shared(self.lm, ("pools", *key[1:]), lambda: self._new_pools(models))
        for i, pool in enumerate(pools.pools):  # each BlockPool in the table too, where code looking for them reads
            pool.attention = self.kv_attention
            _shared(self.lm, (*key, i), lambda pool=pool: pool)
        if joint is not None and len(pools.models) > 1 and pools.models[1] is joint.draft:
            joint.use_pool(pools.pools[1])
        return pools

    def _new_pools(self, models: list[Any]) -> Pools:
        pools = pools_for(
            models,
            self.kv_memory,
            self.kv_block_size,
            self.kv_state_checkpoint_every,
            self.max_seqs,
            self.max_batch_tokens,
            headroom=measured_headroom(self),
            kv_dtype=self.kv_dtype,
        )
        attach_tier(pools.pools[0], self.kv_offload, self.lm)  # the draft model's pool recomputes
        return pools

    def settings(self) -> dict[str, Any]:
        """This chain's pool and engine settings, as keyword arguments for another Pipeline."""
        o = self.kv_offload
        return dict(
            kv_memory=self.kv_memory,
            kv_block_size=self.kv_block_size,
            kv_state_checkpoint_every=self.kv_state_checkpoint_every,
            kv_attention=self.kv_attention,
            kv_dtype=self.kv_dtype,
            kv_offload=o.kind,
            kv_offload_bytes=o.nbytes,
            kv_offload_dir=o.folder,
            max_seqs=self.max_seqs,
            max_batch_tokens=self.max_batch_tokens,
            burst=self.burst,
        )

    @property
    def engine(self) -> Engine:
        """The engine for this pool and these batch limits (shared like the pool)."""
        if self._engine is None:
            decode = self.stages.get("decode")
            fixed = getattr(decode, "fixed_step", None)
            step = fixed(self.lm.device) if fixed is not None else getattr(decode, "compiled", None)
            self._engine = shared_engine(
                self.lm,
                self.pool,
                step,
                max_seqs=self.max_seqs,
                max_batch_tokens=self.max_batch_tokens,
                burst=self.burst,
                matvec=getattr(decode, "matvec", True),
            )
        return self._engine

    def scratch(self, kv_memory: int) -> "Pipeline":
        """A prefill-only copy of this chain on a pool (``kv_memory`` bytes) and engine of its own,
        shared with nothing: dropped, it frees them (``pipeline.engine.headroom`` measures with it)."""
        stages = {name: stage for name, stage in self.stages.items() if name != "decode"}
        other = Pipeline(self.lm, stages, **{**self.settings(), "kv_memory": kv_memory, "kv_offload": "none"})
        other._pools = pools_for(
            [self.lm],
            kv_memory,
            self.kv_block_size,
            self.kv_state_checkpoint_every,
            self.max_seqs,
            self.max_batch_tokens,
            kv_dtype=self.kv_dtype,
        )
        other._pools.pools[0].attention = self.kv_attention
        other._engine = Engine(
            ModelRunner(self.lm, other.pool),
            max_seqs=self.max_seqs,
            max_batch_tokens=self.max_batch_tokens,
            burst=self.burst,
        )
        return other

    def with_stages(self, stages: Mapping[str, Stage]) -> "Pipeline":
        """Another stage chain on the same model, pool and engine (e.g. prefill only, for scoring)."""
        other = Pipeline(self.lm, stages, **self.settings())
        other._pool, other._pools, other._engine, other.warmup_s = self.pool, self._pools, self.engine, self.warmup_s
        return other

    def load_adapter(self, name: str, path: str) -> Adapter:
        """Load a peft LoRA adapter (a folder or a hub id) beside the model, for requests that
        name it (``Request.adapter``); a bad one is refused with a ``UserError`` before it serves
        anything. Every pipeline on this model sees it."""
        return self.lm.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter: new requests cannot name it; those already running finish with it."""
        self.lm.adapters.unload(name)

    def new_cache(self) -> KVCache:
        """An empty sequence on this pipeline's pool (a conversation keeps one across turns)."""
        return KVCache(self.pool)

    # --- running ------------------------------------------------------------------------------
    def submit(
        self,
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
        *,
        ids: Sequence[int] | None = None,
        result: bool = True,
    ) -> Handle:
        """Queue a request; returns at once. ``handle.result()`` gives the Result (the Context
        with ``result=False``); iterating the handle gives token ids as they come.

        ``ids``: raw prompt ids (no template, no media): the stages before prefill are skipped.
        With no ``cache`` the request gets its own, whose blocks go back to the pool (full ones
        into the prefix cache) when it ends.
        """
        if cache is not None and cache.pool is not self.pool:
            raise ValueError("this KVCache belongs to another KV pool: make it with this pipeline's new_cache()")
        if self.compile_on_submit:
            self.compile_ahead()  # decode compile="auto": started by the first request, if not before
        ctx = self.context(request, cache, on_text)
        if ids is not None:
            ctx.input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.engine.device)
            ctx.token_keys = list(ids)
        decode = None if request.pooling is not None else self.stages.get("decode")  # embedding: prefill only
        sampler = request.sampler or getattr(decode, "sampler", None)
        seq = EngineSequence(
            ctx,
            sampler=fork_sampler(sampler),
            phases=self._phases(ids is None, result),
            prefill_only=decode is None,
            release=cache is None and result,
            adapter=None if request.adapter is None else self.lm.adapters.get(request.adapter),
        )
        if decode is not None:
            seq.spec = decode.drafting(seq.sampler)  # speculative decoding: the sequence's own drafter
        ctx.metrics.start()
        return self.engine.submit(seq)

    def _phases(self, front: bool, result: bool) -> Phases:
        """Stages before the engine phases run at admission (``front``: not for raw ids), those
        after ``decode`` once the request ends."""
        names = list(self.stages)
        first = next((i for i, n in enumerate(names) if n in ENGINE_STAGES), len(names))
        last = names.index("decode") + 1 if "decode" in self.stages else len(names)
        decode = self.stages.get("decode")
        return Phases(
            front={n: self.stages[n] for n in names[:first]} if front else {},
            after={n: self.stages[n] for n in names[last:]},
            prefill=self.stages.get("prefill"),
            decode=decode,
            finalize=self.result if result else None,
            processors=decode.logits_processors() if decode is not None else [],
        )

    @staticmethod
    def wait(handle: Handle) -> Any:
        """``handle.result()``; Ctrl-C cancels the request (its blocks are freed) and re-raises."""
        try:
            return handle.result()
        except KeyboardInterrupt:
            handle.cancel()
            handle.wait()
            raise

    def warmup(self, prompt_tokens: int = 16, new_tokens: int = 36, rows: int | None = None) -> float:
        """Run a throwaway batch of three sequences that end one after another (batch sizes 3, 2
        and 1, contexts growing past block boundaries), with decode bursts and again with single
        decode steps, so that the first real request pays no one-off cost: with
        ``decode.compile`` every graph dynamo specialises is built here. ``rows=1``: one
        sequence only, for callers that decode one at a time (``mode=run``, ``mode=chat``): the
        batch-of-one graph alone, a third of the warm-up (a 187M Llama, 2 cores, its graphs in
        Inductor's cache: 6.3 s against 17.7 s); a larger batch would compile when it first runs.
        Reported as ``warmup_s``, never in ``ttft_s``."""
        t0 = time.perf_counter()
        text = " ".join(["warm"] * prompt_tokens)
        ids = self.lm.tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens] or [0]
        lengths = [new_tokens, new_tokens * 2 // 3, new_tokens // 3][: min(self.max_seqs, rows or 3)]
        engine = self.engine
        configured = engine.burst
        try:  # decode bursts and single decode steps (requests waiting, sampled rows) are two graphs
            for burst in dict.fromkeys((configured, 1)):
                engine.burst = burst
                handles = [
                    self.submit(
                        Request(max_new_tokens=n, ignore_eos=True), ids=ids[: max(1, len(ids) - i)], result=False
                    )
                    for i, n in enumerate(lengths)
                ]
                for handle in handles:
                    self.wait(handle).cache.clear()
        finally:
            engine.burst = configured
        synchronize(self.lm.device)
        seconds = time.perf_counter() - t0
        self.warmup_s = (self.warmup_s or 0.0) + seconds
        return seconds

    def compile_ahead(
        self,
        rows: int | None = None,
        wait: bool = False,
        said: Callable[[str], None] | None = None,
        apart: bool = False,
    ) -> float | None:
        """``DecodeLoop(compile="auto")``: build the compiled decode step (its graphs for ``rows``
        sequences at a time; None: any) on a thread beside the engine, which decodes eagerly
        meanwhile and takes the compiled step from the first step after it is ready: the same
        tokens either way (``pipeline.runner.compiled``). Unless called before, the first request
        starts it (``compile_on_submit``). ``wait``: block until it is built; the seconds waited
        are returned and reported as ``warmup_s``. ``said``: told one line when a build beside
        the engine ends. ``apart``: a first compile runs in a process of its own
        (``pipeline.runner.compile_apart``), sharing no lock with the engine's answers meanwhile,
        for an engine with time to spare between answers (a chat): one kept busy starves it."""
        builder = self.engine.runner.compile_ahead(rows, said, apart=apart)
        if not wait or builder is None:
            return None
        t0 = time.perf_counter()
        builder.join()
        seconds = time.perf_counter() - t0
        self.warmup_s = (self.warmup_s or 0.0) + seconds
        return seconds

    def compile_cached(self, rows: int | None = None) -> bool:
        """Whether a ``compile_ahead(rows)`` would find its graphs in Inductor's on-disk caches (a
        process built them before: ``inductor_cache.compile_record``), so waiting for it costs
        seconds, not a first compile's minute."""
        return "first_s" in self.compile_record(rows)

    def compile_record(self, rows: int | None = None) -> dict[str, Any]:
        """What Inductor's cache folder knows of the ``compile="auto"`` step for ``rows``: its
        first build's seconds, its recent cached builds' median, an eager step's
        (``inductor_cache.compile_record``)."""
        return self.engine.runner.compile_record(rows)

    def compile_pays(self, tokens: int, rows: int | None = None) -> bool:
        """Whether waiting for ``compile_ahead(rows)`` before an answer of up to ``tokens`` tokens
        is worth it: only for a cached compile, and only where its cached builds took (the median
        of the last five) no longer than the answer would eagerly (the eager step's recorded
        seconds; a figure not recorded yet counts as worth it, so that it is measured)."""
        record = self.compile_record(rows)
        if "first_s" not in record:
            return False
        cached, eager = record.get("cached_s"), record.get("eager_token_s")
        return cached is None or eager is None or cached <= tokens * eager

    def note_eager_step(self, seconds: float, rows: int | None = None) -> None:
        """Record what an eager decode step took (``compile_pays`` weighs a later run's wait by it)."""
        self.engine.runner.note_eager_step(seconds, rows)

    @property
    def compile_pending(self) -> bool:
        """A ``compile="auto"`` step is not built yet (running beside the engine, or not started)."""
        step = self.engine.runner.compiled
        return isinstance(step, CompiledStep) and step.auto and not step.ready.is_set()

    @property
    def compile_failed(self) -> str | None:
        """Why the compiled step could not be built, once a build failed (the engine stays eager)."""
        step = self.engine.runner.compiled
        return step.broken if isinstance(step, CompiledStep) else None

    def run(
        self,
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Result:
        """Run one request. Pass the same ``cache`` again to reuse what it already holds."""
        return self.wait(self.submit(request, cache, on_text))

    def run_context(
        self,
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Context:
        """Like ``run`` but returns the whole Context, for recipes that need more than the Result
        (e.g. C-Eval scores prefill's next-token logits)."""
        return self.wait(self.submit(request, cache, on_text, result=False))

    def run_ids(
        self,
        ids: Sequence[int],
        request: Request,
        cache: KVCache | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Context:
        """Run the stages after tokenization on raw prompt ids (no chat template, no media):
        synthetic benchmark prompts, cache experiments, tests."""
        return self.wait(self.submit(request, cache, on_text, ids=ids, result=False))

    def run_many(
        self,
        requests: Iterable[tuple],
        *,
        result: bool = True,
        window: int | None = None,
        after: Callable[[Hashable], Iterable[tuple]] | None = None,
    ) -> Iterator[tuple[Hashable, Any]]:
        """Run many requests concurrently; yields ``(key, Result | Context | exception)`` as each ends.

        Items are ``(key, request)``, or ``(key, request, ids)`` with raw prompt ids (as ``submit``).
        At most ``window`` requests are taken from ``requests`` at once (default: 4 x max_seqs), so
        a huge input stays cheap. ``after(key)``: items queued as soon as ``key`` ends, which find
        what it left in the prefix cache (a question's other choices after its first). Leaving the
        loop early (an exception, Ctrl-C, ``break``) cancels the rest.
        """
        window = window or 4 * self.max_seqs
        finished: queue.Queue = queue.Queue()
        pending: dict[Handle, Hashable] = {}
        source = iter(requests)
        exhausted = False

        def queue_item(key: Hashable, request: Request, ids: Sequence[int] | None = None) -> None:
            handle = self.submit(request, ids=ids, result=result)
            pending[handle] = key
            handle.add_done_callback(finished.put)

        try:
            while True:
                while not exhausted and len(pending) < window:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                    queue_item(*item)
                if not pending:
                    return
                self.engine.drive(lambda: not finished.empty())
                handle = finished.get()
                key = pending.pop(handle)
                for item in after(key) if after is not None else ():
                    queue_item(*item)
                try:
                    yield key, handle.result()
                except Exception as err:
                    yield key, err
        finally:
            for handle in pending:
                handle.cancel()
            self.engine.drive(lambda: all(h.done() for h in pending))

    @torch.inference_mode()
    def tokenize(self, request: Request) -> Context:
        """Only the tokenize stage: the ids and cache keys a request renders to."""
        ctx = self.context(request, KVCache(self.pool))
        self.stages["tokenize"](ctx)
        return ctx

    def context(
        self, request: Request, cache: KVCache | None = None, on_text: Callable[[str], None] | None = None
    ) -> Context:
        """A fresh Context, for users who drive stages by hand."""
        return Context(
            request=request,
            lm=self.lm,
            cache=cache if cache is not None else self.new_cache(),
            metrics=Metrics(self.lm.device),
            on_text=on_text,
        )

    def result(self, ctx: Context) -> Result:
        m = ctx.metrics
        m.set("kv_cache_bytes", ctx.cache.nbytes)
        m.set("weights_bytes", self.lm.weights_bytes)
        if self._decode_weights is None:
            self._decode_weights = decode_weight_bytes(self.lm.model, self.lm.family.encoder_modules)
        m.set("decode_weights_bytes", self._decode_weights)
        if self.warmup_s is not None:
            m.set("warmup_s", self.warmup_s)
        m.info["quant"] = self.lm.quant
        if ctx.request.adapter is not None:
            m.info["adapter"] = ctx.request.adapter
        m.info["placement"] = {dev: dict(kinds) for dev, kinds in self.lm.placement.items()}  # device -> kind -> bytes
        return Result(
            text=ctx.text,
            token_ids=list(ctx.generated),
            prompt_ids=ctx.input_ids[0].tolist() if ctx.input_ids is not None else [],
            metrics=m.to_dict(),
            finish_reason=ctx.finish_reason,
            logprobs=list(ctx.logprobs) if ctx.request.logprobs is not None else None,
            prompt_logprobs=None
            if ctx.request.prompt_logprobs is None
            else [ctx.prompt_logprobs.get(p) for p in range(ctx.input_ids.shape[1])],
            embedding=None if ctx.request.pooling is None else embedding(ctx),
        )
