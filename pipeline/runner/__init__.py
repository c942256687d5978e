"""The runner layer: from scheduled chunks to logits.

- ``paged_batch``: packing chunks into one forward (``Chunk``, ``build_batch``);
- ``attention`` / ``linear``: paged attention and linear-attention layers over the pool;
- ``forward``: the model call and the greedy decode burst;
- ``compiled``: the ``torch.compile``'d decode step;
- ``graphs``: the eager decode step captured and replayed as CUDA graphs (the CUDA default);
- ``matvec``: one-row linear layers on a native CPU kernel (``matvec.cpp``), built on first use;
- ``model_runner``: ``ModelRunner``, the one object the engine runs the model through;
- ``grammar``: output constraints (xgrammar's bitmasks); choosing tokens is ``pipeline.sampling``.

Imports ``pipeline.sampling`` and ``pipeline.kv`` (and the leaf modules ``errors``, ``transfer``) only
(see ``[tool.importlinter]``).
"""

from pipeline.runner.attention import ATTENTION, attach, detach, paged_attention
from pipeline.runner.paged_batch import Chunk, PagedBatch, build_batch
from pipeline.runner.compiled import CompiledStep, FastPathFallback
from pipeline.runner.graphs import GraphedStep
from pipeline.runner.forward import burst_state, forward, greedy_steps, run_burst, run_model
from pipeline.runner.model_runner import ModelRunner, StepOutput

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
    "ModelRunner",
    "StepOutput",
]
