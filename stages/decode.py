"""DecodeLoop: one token per step from the KV cache, the Sampler choosing each token.

An engine phase: a request run through ``Pipeline.run`` decodes in a batch with whatever else is
in flight, and the engine calls this stage's hooks for every sequence:

- ``process_logits(logits, contexts) -> logits``: the per-sequence logits hook, called once per
  step with the rows of every sequence of this stage ([n, V], one Context each);
- ``on_token(ctx, token_id) -> bool``: sees each new token; True stops the sequence
  (``finish_reason`` "stop");
- ``sampler``: each sequence draws with its own copy (a ``Sampler`` subclass is called on its
  rows; only the built-in greedy sampler is argmaxed with other rows directly).

Override hooks in a subclass (``stages.decode._target_=my_pkg.MyDecode``); a subclass that
overrides ``__call__`` instead is refused before the model loads (the engine never calls it).
Driven by hand on a prefilled context, this stage runs the model's shared engine on a batch
of one. Either way the host reads each token as it comes, so EOS, stop strings and streaming
act at once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pipeline.context import Context
from pipeline.engine import Drafting, Phases, Sequence, TextStream
from pipeline.errors import UserError
from pipeline.pipeline import shared_engine
from pipeline.runner import CompiledStep, FastPathFallback, GraphedStep
from pipeline.runner.compiled import compile_choice
from pipeline.sampling import fork_sampler
from pipeline.spec import Speculative
from stages.sampler import Sampler

__all__ = [
    "DecodeLoop",
    "Speculative",
    "FastPathFallback",
    "TextStream",
]  # the last two: importable from here since 0.1


class DecodeLoop:
    """Samples the first token from prefill's logits, then decodes until EOS, a stop string,
    ``on_token`` or ``max_new_tokens``. Text streams through ``ctx.on_text`` when set.

    ``sampler``: the settings every request starts from (each request draws with its own copy,
    seeded afresh). ``compile``: decode steps run the compiled forward (``pipeline.runner.compiled``);
    ``"auto"`` (the command line's default): compiled ahead beside the eager steps on CPU with the
    native kernels, which switch to it once built (``Pipeline.compile_ahead``), CUDA graphs on a GPU;
    ``compile_backend`` (``inductor``, or e.g. ``aot_eager`` to check graph capture without code
    generation) and ``compile_mode`` go to ``torch.compile``. ``cuda_graphs`` (without ``compile``):
    on CUDA the eager decode step is captured per shape bucket and replayed as CUDA graphs
    (``pipeline.runner.graphs``); no effect on CPU. ``speculative``: a ``Speculative``
    (n-gram lookup or a draft model) whose drafts every decode step verifies: same tokens, fewer
    target forwards. ``matvec``: on CPU, the native kernels run where they apply (one sequence's
    linear layers, ``pipeline.runner.matvec``; decode attention over the pool in place, batched
    bfloat16 products on prepacked weights); False: PyTorch's kernels.
    """

    def __init__(
        self,
        sampler: Callable | None = None,
        compile: bool | str = False,
        compile_mode: str | None = None,
        compile_backend: str = "inductor",
        speculative: Speculative | None = None,
        matvec: bool = True,
        cuda_graphs: bool = True,
    ) -> None:
        self.sampler = sampler if sampler is not None else Sampler()
        self.compile = compile_choice(compile)
        self.matvec = bool(matvec)
        self.cuda_graphs = bool(cuda_graphs)
        auto = self.compile == "auto"
        self.compiled = CompiledStep(compile_backend, compile_mode, auto=auto) if self.compile else None
        # Without compile (or auto, which compiles on CPU only): CUDA graphs of the eager step (a
        # runner on CPU leaves them out).
        self.graphed = GraphedStep() if self.cuda_graphs and self.compile is not True else None
        if speculative is not None and not isinstance(speculative, Speculative):
            raise TypeError(f"speculative must be a stages.Speculative, got {type(speculative).__name__}")
        self.speculative = speculative if speculative is not None and speculative.enabled else None

    # --- hooks the engine calls -----------------------------------------------------------------
    def process_logits(self, logits: torch.Tensor, contexts: list[Context]) -> torch.Tensor:
        """Hook: this step's next-token logits [n, V] (float32) of this stage's sequences, one
        Context each; return them processed (same shape). The base class leaves them alone and
        is never called."""
        return logits

    def on_token(self, ctx: Context, token_id: int) -> bool:
        """Hook: ``token_id`` was just appended to ``ctx.generated`` (and streamed); return True
        to stop the sequence here."""
        return False

    def fixed_step(self, device: torch.device | None = None) -> CompiledStep | GraphedStep | None:
        """The fixed-shape decode step the model runner takes on ``device``: compiled, CUDA graphs,
        or None (``compile="auto"``: compiled on CPU, CUDA graphs on a GPU)."""
        if self.compiled is not None and (device is None or self.compiled.applies(device)):
            return self.compiled
        return self.graphed

    def logits_processors(self) -> list:
        """The processors the engine runs on this stage's rows: ``process_logits`` if overridden."""
        return [self.process_logits] if type(self).process_logits is not DecodeLoop.process_logits else []

    def drafting(self, sampler: Any) -> Drafting | None:
        """A sequence's own drafter when this stage decodes speculatively (None otherwise)."""
        if self.speculative is None:
            return None
        if not isinstance(sampler, Sampler):  # verification needs its filters and random draws
            raise UserError(
                f"speculative decoding needs a stages.Sampler (got {type(sampler).__name__}): "
                "set decode.speculative=none to use another sampler"
            )
        return Drafting(self.speculative.drafter(), self.speculative.num_draft)

    def check_phase(self, name: str) -> None:
        """Refuse a subclass the engine cannot honour (called before the model loads)."""
        if type(self).__call__ is not DecodeLoop.__call__:
            raise UserError(
                f"stages.{name}: {type(self).__name__} overrides __call__, which the engine never calls "
                "(it decodes many requests at once): override process_logits or on_token instead"
            )
        if self.speculative is not None and self.logits_processors():
            raise UserError(
                f"stages.{name}: {type(self).__name__} overrides process_logits, which speculative "
                "decoding cannot apply to drafted positions: set decode.speculative=none"
            )

    # --- by hand ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def __call__(self, ctx: Context) -> Context:
        if ctx.request.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {ctx.request.max_new_tokens})")
        if ctx.logits is None:
            raise ValueError("DecodeLoop needs prefill logits: run Prefill on this context first")
        sampler = fork_sampler(self.sampler)
        seq = Sequence(
            ctx, sampler, Phases(decode=self, processors=self.logits_processors()), spec=self.drafting(sampler)
        )
        seq.pending = ctx.logits
        shared_engine(ctx.lm, ctx.cache.pool, self.fixed_step(ctx.lm.device), matvec=self.matvec).run([seq])
        return ctx
