"""The processes of a data-parallel launch (``accelerate launch`` / ``torchrun``): each loads its
own copy of the model; modes that split their work over them (batch, eval) share these. Under
tensor parallel the copies are the tensor-parallel groups (``model.tp=N`` in a launch of k x N
processes), each driven by its rank 0, which alone takes part here."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, parse_flag_from_env
from omegaconf import DictConfig, open_dict

from pipeline.model import tensor_parallel
from pipeline.cli.outputs import run_dir


def process_state(sync_timeout_s: float = 86400) -> Any:
    """accelerate's view of the launch: one process under plain python, N under accelerate/torchrun.

    On a machine without CUDA, accelerate only joins the ranks (gloo) when told ``cpu=True``.
    Ranks that finish early wait at a barrier for the slowest one: the process group's timeout
    (torch's default is 30 minutes) must outlast the longest shard, hence ``sync_timeout_s``.
    """
    if tensor_parallel.requested() > 1:
        group = tensor_parallel.start(tensor_parallel.requested())  # joined now: the modes split work before loading
        return OneProcess() if group.replicas == 1 else Groups(group)
    cpu = not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    return PartialState(cpu=cpu, timeout=timedelta(seconds=sync_timeout_s))


class OneProcess:
    """The view a mode has of a tensor-parallel launch of one group: its rank 0 does the work."""

    num_processes, process_index, is_main_process = 1, 0, True
    group = None  # torch.distributed's group of the processes that share the work (None: the default)

    @staticmethod
    def wait_for_everyone() -> None:
        return None


class Groups:
    """The view a mode has of several tensor-parallel groups in one launch: each group's rank 0 is
    one process of the data-parallel split (the first group's is the main one); the rest of each
    group follows its rank 0's steps and takes no part here."""

    def __init__(self, group: tensor_parallel.Group) -> None:
        self.num_processes, self.process_index = group.replicas, group.replica
        self.is_main_process = group.replica == 0
        self.group = group.leaders

    def wait_for_everyone(self) -> None:
        torch.distributed.barrier(group=self.group)


def shared_run_dir(state: Any) -> Path:
    """Rank 0's run folder, for every rank (each rank's Hydra may have stamped its own time)."""
    mine = run_dir().resolve()
    if state.num_processes == 1:
        return mine
    box = [str(mine)]
    if getattr(state, "group", None) is not None:  # tensor-parallel groups: their rank 0s
        torch.distributed.broadcast_object_list(box, src=0, group=state.group)
    else:
        broadcast_object_list(box, from_process=0)
    chosen = Path(box[0])
    if chosen != mine:
        chosen.mkdir(parents=True, exist_ok=True)
        _remove_if_only_hydra(mine)
    return chosen


def _remove_if_only_hydra(folder: Path) -> None:
    """Drop a folder this rank's Hydra made for nothing (only .hydra/ and its log inside)."""
    try:
        if all(p.name == ".hydra" or p.suffix == ".log" for p in folder.iterdir()):
            shutil.rmtree(folder)
    except OSError:
        pass


def place_on_rank(cfg: DictConfig, state: Any) -> None:
    """With several processes and no explicit placement, each loads its copy on its own device
    (tensor parallel places its shards itself)."""
    if state.num_processes > 1 and cfg.model.get("device_map") is None and tensor_parallel.requested() == 1:
        device = state.device
        with open_dict(cfg):
            cfg.model.device_map = {"": "cpu" if device.type == "cpu" else str(device)}
