"""Tensor parallel (``model.tp=N`` under ``torchrun``): the launch, its checks, and the channel rank 0
drives the other ranks through. A launch of a multiple of N processes makes several groups of N,
each with its own engine (data parallel over the groups: batch and eval split their items over
the groups' rank 0s).

transformers shards the weights (``DistributedConfig``: the architecture's own plan, DTensor on
``torch.distributed``); mm-pipeline adds one engine over the ranks: rank 0 runs the front stages,
the scheduler, sampling and all I/O, and before each model step sends the other ranks what the
forward needs (``pipeline.runner.mirror``); every rank runs the same forward on its shard, the
collectives inside it keep them in step, and each rank's KV pool holds its own share of the
key/value heads. gloo on CPU, NCCL on CUDA.

Everything here is checked before any weight loads: what cannot work is one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch

from pipeline.errors import UserError
from pipeline.memory import kv_shape, text_config

# How long a rank waits for the next message. Long: the other ranks wait on rank 0's next step
# through every idle minute of a chat or a server; a rank that dies closes its sockets, which the
# others see at once (and torchrun stops the whole group when one process fails).
IDLE_TIMEOUT = timedelta(days=7)
BITSANDBYTES = ("nf4", "fp4", "int8")


@dataclass
class Group:
    """This process's place in a tensor-parallel launch: ``rank`` of ``size`` within its group, the
    group ``replica`` of ``replicas`` (several groups in one launch: data parallel over groups).

    ``leader``: the global rank of the group's rank 0; ``ranks``: the group's process group, and
    ``leaders``: the group of every group's rank 0 (both None with one group: the default group)."""

    rank: int
    size: int
    replica: int = 0
    replicas: int = 1
    leader: int = 0
    ranks: Any = None
    leaders: Any = None

    @property
    def driver(self) -> bool:
        """The group's rank 0: owns its engine, the front stages and every output."""
        return self.rank == 0

    def send(self, message: Any) -> None:
        """Rank 0: one message to every other rank (a pickled object, broadcast). Whole messages
        from any thread (the engine's steps, a runner announced by another thread, the stop)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with _SEND_LOCK:
            self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
            self._broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self) -> Any:
        """Ranks 1..N-1: rank 0's next message (waits as long as rank 0 is idle)."""
        size = torch.empty(1, dtype=torch.int64)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        # CPU tensors: over gloo even where the forward's collectives run on NCCL ("cpu:gloo,cuda:nccl")
        torch.distributed.broadcast(tensor, src=self.leader, group=self.ranks)


_GROUP: list[Group] = []
_SEND_LOCK = threading.Lock()
_REQUESTED = [1]  # model.tp of this run (``request``)


SPLIT_MODES = ("batch", "eval")  # the modes that split their items over several groups


def request(tp: int, mode: str = "run") -> None:
    """A run of ``mode`` with ``model.tp=tp`` starts (checked against the launch, one line if they
    disagree: only the modes that split their work run on several groups)."""
    check_launch(tp)
    groups = launched_size() // tp
    if tp > 1 and groups > 1 and mode not in SPLIT_MODES:
        raise UserError(
            f"model.tp={tp} in a launch of {launched_size()} processes makes {groups} tensor-parallel "
            f"groups, which only mode=batch and mode=eval split work over: start {tp} processes for "
            f"mode={mode}"
        )
    _REQUESTED[0] = tp


def requested() -> int:
    return _REQUESTED[0]


def follower() -> bool:
    """Whether this process is rank 1..N-1 of its tensor-parallel group (it follows rank 0's steps)."""
    return requested() > 1 and int(os.environ.get("RANK", "0")) % requested() > 0


def current() -> Group | None:
    """The launch's group once ``start`` ran with ``model.tp`` > 1; None in a single process."""
    return _GROUP[0] if _GROUP else None


def launched_size() -> int:
    """How many processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launch(tp: int) -> None:
    """``model.tp`` against how the process was started: one line when they disagree."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise UserError(f"model.tp must be a whole number >= 1 (got {tp!r})")
    world = launched_size()
    if tp > 1 and "RANK" not in os.environ:
        raise UserError(
            f"model.tp={tp} needs one process per shard: torchrun --nproc-per-node {tp} -m pipeline model.tp={tp} ..."
        )
    if tp > 1 and world % tp:
        raise UserError(
            f"model.tp={tp} under a launch of {world} processes: start a multiple of {tp} "
            f"(torchrun --nproc-per-node {tp}, or {2 * tp} for two tensor-parallel groups)"
        )


def check_model(config: Any, tp: int, quant: str, recurrent: bool) -> None:
    """What the model and settings must allow for ``tp`` shards, judged on config.json alone."""
    if tp == 1:
        return
    text = text_config(config)
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if not plan:
        raise UserError(f"model.tp={tp}: {arch} has no tensor-parallel plan in transformers (base_model_tp_plan)")
    if recurrent:
        raise UserError(f"model.tp={tp}: {arch} has linear-attention layers, whose recurrent states are not sharded")
    _, kv_heads, _ = kv_shape(config)
    heads = int(text.num_attention_heads)
    if kv_heads % tp or heads % tp:
        raise UserError(f"model.tp={tp} must divide the attention heads ({heads}) and key/value heads ({kv_heads})")
    if quant in BITSANDBYTES:
        raise UserError(
            f"model.tp={tp} with quant={quant}: bitsandbytes weights cannot be sharded; use quant=none "
            "or quant=int8wo / int4wo (torchao)"
        )


def quantised_after_sharding(quantization_config: Any) -> Any:
    """The TorchAoConfig that ``quantize_shards`` applies after loading, for int8wo; None for any
    other config (transformers' own loading quantises those)."""
    quant_type = getattr(quantization_config, "quant_type", None)
    return quantization_config if type(quant_type).__name__ == "Int8WeightOnlyConfig" else None


def quantize_shards(model: Any, quantization_config: Any, group: Group | None) -> None:
    """int8wo under tensor parallel, holding on each rank the slice of what one process holds.

    int8wo keeps one scale per output row: the largest weight of the row / 127.5. transformers'
    loading would quantise each rank's shard alone, so a row split over the ranks (row-wise
    layers: ``o_proj``, ``down_proj``) got a scale of its half and other int8 values than one
    process, whose greedy tokens then differed. Here the model loads in full precision, and each
    split row's scale is the largest of the ranks' (an all-reduce), as the whole row's would be.
    The layers converted are those transformers' quantiser converts (same skips)."""
    from torch.distributed.tensor import DTensor
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
    from transformers.quantizers.quantizers_utils import should_convert_module

    skips = [
        *(quantization_config.modules_to_not_convert or []),
        *(getattr(model, "_keep_in_fp32_modules", None) or []),
    ]
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not should_convert_module(f"{name}.weight", skips):
            continue
        weight = module.weight
        local = (weight.to_local() if isinstance(weight, DTensor) else weight).detach()
        quantised = Int8Tensor.from_hp(local, PerRow())
        if _splits_rows(weight):
            scale = quantised.scale.clone()
            torch.distributed.all_reduce(scale, op=torch.distributed.ReduceOp.MAX, group=group.ranks if group else None)
            quantised = Int8Tensor.from_hp(local, PerRow(), scale=scale)
        module.weight = torch.nn.Parameter(quantised, requires_grad=False)


def _splits_rows(weight: Any) -> bool:
    """A weight sharded along its inputs (a row-wise layer): each rank holds part of every row."""
    placements = getattr(weight, "placements", ())
    return any(p.is_shard() and p.dim % weight.ndim == weight.ndim - 1 for p in placements)


def distributed_config(tp: int, config: Any) -> Any:
    """transformers' settings for ``tp`` shards on the architecture's own plan. Where the output layer
    is the input embeddings' matrix (tied: Gemma, PaliGemma, Llama 3.2 1B/3B) it is replicated like
    them (``plan_config``): one parameter cannot be whole for the embedding and split for the logits,
    and split it gave every rank wrong embeddings."""
    from transformers.distributed import DistributedConfig

    tied = any(getattr(c, "tie_word_embeddings", False) for c in (config, text_config(config)))
    return DistributedConfig(tp_size=tp, tp_plan={"lm_head": "replicate"} if tied else None)


@contextlib.contextmanager
def sharding_within_groups(group: Group | None) -> Iterator[None]:
    """transformers lays its device mesh over every process of the launch. With several
    tensor-parallel groups its mesh gets them as a replica dimension (``dp_replicate``), so each
    process shards over its own group's ranks; the config it acts on keeps one replica (no FSDP
    wrapping: the groups run different requests, not one model's steps). transformers has no
    argument for a mesh of ours; this wraps the one function that builds it, checked to exist."""
    if group is None or group.replicas == 1:
        yield
        return
    from transformers.distributed import mixin

    build = getattr(mixin, "initialize_distributed_mesh", None)
    if build is None:
        raise UserError(
            "several tensor-parallel groups in one launch need transformers' "
            "distributed.mixin.initialize_distributed_mesh (transformers 5.x); start one group per launch"
        )
    mixin.initialize_distributed_mesh = lambda config: build(
        dataclasses.replace(config, dp_replicate_size=group.replicas)
    )
    try:
        yield
    finally:
        mixin.initialize_distributed_mesh = build


def plan_config(config: Any) -> Any:
    """``config`` with the input embeddings replicated instead of split over the vocabulary
    (transformers' default): rank 0's front stages embed a prompt to merge media into it alone,
    which a split embedding (an all-reduce) would make every rank join. The price is the
    embedding matrix on every rank (vocabulary x hidden)."""
    for part in {id(c): c for c in (config, text_config(config))}.values():
        plan = getattr(part, "base_model_tp_plan", None)
        if plan:
            part.base_model_tp_plan = {**plan, "embed_tokens": "replicate"}
    return config


def start(tp: int) -> Group | None:
    """Join the launch's process group (once per process) for ``tp`` shards; None when tp is 1."""
    check_launch(tp)
    if tp == 1:
        return None
    if _GROUP:
        return _GROUP[0]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(torch.device("cuda", local))  # each rank's shard on its own GPU
        backend = "cpu:gloo,cuda:nccl"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, timeout=IDLE_TIMEOUT)
    rank, replicas = torch.distributed.get_rank(), torch.distributed.get_world_size() // tp
    group = Group(rank % tp, tp, replica=rank // tp, replicas=replicas, leader=rank - rank % tp)
    if replicas > 1:  # every process creates every group, in the same order (torch.distributed's rule)
        groups = [torch.distributed.new_group(list(range(r * tp, (r + 1) * tp))) for r in range(replicas)]
        group.ranks = groups[group.replica]
        group.leaders = torch.distributed.new_group(list(range(0, replicas * tp, tp)), backend="gloo")
    _GROUP.append(group)
    return group


def finish() -> None:
    """The end of a run: rank 0 tells the other ranks to stop; every rank leaves the group."""
    if _GROUP and torch.distributed.is_initialized():
        if _GROUP[0].driver:
            try:
                _GROUP[0].send(("stop", None))
            except RuntimeError:
                pass  # the other ranks are gone already (they failed, or the launcher stopped them)
        torch.distributed.destroy_process_group()
    _GROUP.clear()
    _REQUESTED[0] = 1
