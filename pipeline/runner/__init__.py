"""The runner layer: from scheduled chunks to logits.

- ``batch``: packing chunks into one forward (``Chunk``, ``build_batch``);
- ``attention`` / ``linear``: paged attention and linear-attention layers over the pool;
- ``forward``: the model call and the greedy decode burst;
- ``compiled``: the ``torch.compile``'d decode step;
- ``graphs``: the eager decode step captured and replayed as CUDA graphs (the CUDA default);
- ``matvec``: one-row linear layers on a native CPU kernel (``matvec.cpp``), built on first use;
- ``model_runner``: ``ModelRunner``, the one object the engine runs the model through;
- ``logits`` / ``sampling``: the per-sequence logits hook and choosing tokens;
- ``grammar`` / ``logprobs``: output constraints (xgrammar's bitmasks) and log-probabilities.

Imports ``pipeline.kv`` (and the leaf modules ``errors``, ``transfer``) only (see ``[tool.importlinter]``).
"""

from pipeline.runner.attention import ATTENTION, attach, detach, paged_attention
from pipeline.runner.batch import Chunk, PagedBatch, build_batch
from pipeline.runner.compiled import CompiledStep, FastPathFallback
from pipeline.runner.graphs import GraphedStep
from pipeline.runner.forward import burst_state, forward, greedy_steps, run_burst, run_model
from pipeline.runner.logits import LogitsProcessor, apply_processors
from pipeline.runner.model_runner import ModelRunner, StepOutput
from pipeline.runner.sampling import argmax_only, choose, fork_sampler

__all__ = [
    "ATTENTION",
    "attach",
    "detach",
    "paged_attention",
    "Chunk",
    "PagedBatch",
    "build_batch",
    "CompiledStep",
    "GraphedStep",
    "FastPathFallback",
    "burst_state",
    "forward",
    "greedy_steps",
    "run_burst",
    "run_model",
    "LogitsProcessor",
    "apply_processors",
    "ModelRunner",
    "StepOutput",
    "argmax_only",
    "choose",
    "fork_sampler",
]
