"""The processes of a data-parallel launch (``accelerate launch`` / ``torchrun``): each loads its
own copy of the model; modes that split their work over them (batch, eval) share these."""
from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, parse_flag_from_env
from omegaconf import DictConfig, open_dict

from pipeline import tensor_parallel
from pipeline.outputs import run_dir


def process_state(sync_timeout_s: float = 86400) -> Any:
    """accelerate's view of the launch: one process under plain python, N under accelerate/torchrun.

    On a machine without CUDA, accelerate only joins the ranks (gloo) when told ``cpu=True``.
    Ranks that finish early wait at a barrier for the slowest one: the process group's timeout
    (torch's default is 30 minutes) must outlast the longest shard, hence ``sync_timeout_s``.
    """
    if tensor_parallel.requested() > 1:
        return OneProcess()  # the ranks are one engine's shards: rank 0 alone runs the mode
    cpu = not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    return PartialState(cpu=cpu, timeout=timedelta(seconds=sync_timeout_s))


class OneProcess:
    """The view a mode has of a tensor-parallel launch: one process (rank 0) does its work."""

    num_processes, process_index, is_main_process = 1, 0, True

    @staticmethod
    def wait_for_everyone() -> None:
        return None


def shared_run_dir(state: Any) -> Path:
    """Rank 0's run folder, for every rank (each rank's Hydra may have stamped its own time)."""
    mine = run_dir().resolve()
    if state.num_processes == 1:
        return mine
    box = [str(mine)]
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
    """With several processes and no explicit placement, each loads its copy on its own device."""
    if state.num_processes > 1 and cfg.model.get("device_map") is None:
        device = state.device
        with open_dict(cfg):
            cfg.model.device_map = {"": "cpu" if device.type == "cpu" else str(device)}
