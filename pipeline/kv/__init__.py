"""The KV layer: where a sequence's past lives.

- ``pool``: the block manager (fixed-size blocks, reference counts, the hash-chained prefix cache);
- ``states``: recurrent-state slots for linear-attention layers (Qwen3.5), kept like blocks;
- ``cache``: ``KVCache``, one sequence's block table (reuse, rollback, snapshot, fork), and
  ``checkpoints``, its recurrent-state checkpoints;
- ``sizing``: ``kv.memory`` turned into a pool.

The bottom layer: it imports nothing else of the engine (see ``[tool.importlinter]``).
"""

from pipeline.errors import OutOfBlocks
from pipeline.kv.cache import KVCache, Snapshot, shared_prefix_length
from pipeline.kv.pool import ATTENTION, NULL_BLOCK, BlockPool
from pipeline.kv.sizing import kv_memory_setting, pool_for, state_budget
from pipeline.kv.states import LINEAR, ZERO_SLOT, OutOfSlots, StateIO, StateShape, StateSlots, state_shape

__all__ = [
    "ATTENTION",
    "KVCache",
    "Snapshot",
    "shared_prefix_length",
    "BlockPool",
    "NULL_BLOCK",
    "OutOfBlocks",
    "kv_memory_setting",
    "pool_for",
    "state_budget",
    "LINEAR",
    "ZERO_SLOT",
    "OutOfSlots",
    "StateIO",
    "StateShape",
    "StateSlots",
    "state_shape",
]
