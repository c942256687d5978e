"""What the project's trained tiny models share: the decoder's sizes from a recipe, answer-only
batches and their loss, the optimiser and its schedule, the training loop, and writing the
finished model directory in one move.

Why one place: the embedded default (``train_shapes``) and the speculative-decoding pair
(``train_copy``) are trained the same way; only their data, loss and sizes differ.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pipeline.testing.build import _quiet_progress
from pipeline.testing.common import MARKER_FILE

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Schedule(Protocol):
    """The recipe fields the loop reads (each trainer's ``Recipe`` has them)."""

    steps: int
    lr: float
    min_lr_fraction: float
    warmup: int
    weight_decay: float
    grad_clip: float


class Sizes(Protocol):
    """The recipe fields that size the decoder (each trainer's ``Recipe`` has them)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    init_range: float


def decoder_sizes(recipe: Sizes) -> dict[str, Any]:
    """The decoder's config settings at the recipe's sizes (over the tiny builder's, whose token ids stay)."""
    return dict(
        hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate,
        num_hidden_layers=recipe.layers,
        max_window_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        initializer_range=recipe.init_range,
    )


def answer_batch(rows: list[tuple[list[int], list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """(prompt ids, answer ids) rows right-padded with ``pad``: ``input_ids``, ``attention_mask``, and
    ``labels`` on the answer only (-100 elsewhere), so the loss is on what the model should answer."""
    size = (len(rows), max(len(p) + len(a) for p, a in rows))
    ids = torch.full(size, pad, dtype=torch.long)
    labels = torch.full(size, -100, dtype=torch.long)
    mask = torch.zeros(size, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        mask[i, : len(p) + len(a)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def answer_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy over the labelled (answer) positions of ``answer_batch``'s ``labels``;
    with it, per position whether the argmax is the label (teacher-forced) and which positions are
    labelled, both aligned to the shifted labels."""
    logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != -100
    loss = F.cross_entropy(logits[mask].float(), labels[mask])
    return loss, logits.detach().argmax(-1) == labels, mask


def lr_at(step: int, recipe: Schedule) -> float:
    """Linear warm-up, then cosine down to ``min_lr_fraction`` of the peak."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    floor = recipe.min_lr_fraction
    return recipe.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def fit(
    model: PreTrainedModel,
    recipe: Schedule,
    next_batch: Callable[[int], Any],
    loss_of: Callable[[Any], tuple[torch.Tensor, float]],
    desc: str,
    metric: str = "acc",
    progress: bool = True,
) -> dict[str, float]:
    """``recipe.steps`` AdamW steps (no weight decay on norms and biases, clipped gradients);
    ``next_batch(step)`` gives a batch, ``loss_of(batch)`` its loss and an accuracy shown as
    ``metric`` on the progress bar. Returns the training seconds and the smoothed final loss."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.98),
    )
    start = time.monotonic()
    smooth = acc = None
    model.train()
    with tqdm(total=recipe.steps, desc=desc, disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        for step in range(recipe.steps):
            batch = next_batch(step)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, recipe)
            loss, accuracy = loss_of(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            opt.step()
            value = loss.item()
            smooth = value if smooth is None else 0.98 * smooth + 0.02 * value
            acc = accuracy if acc is None else 0.98 * acc + 0.02 * accuracy
            bar.set_postfix({"loss": f"{smooth:.4f}", metric: f"{acc:.3f}"}, refresh=False)
            bar.update(1)
    model.eval()
    return {"train_seconds": round(time.monotonic() - start, 1), "final_loss": round(smooth, 5)}


@contextmanager
def reproducible(threads: int) -> Iterator[None]:
    """Deterministic kernels on ``threads`` threads inside the block; the caller's settings are
    restored after. Why restore: deterministic mode also fills every new tensor, so a process
    that trains and then serves would touch all of a lazily used KV pool at once."""
    before = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1], warn_only=before[2])


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A private directory beside ``out`` to write into; moved into place only when the block
    finishes, so an interrupted run never leaves a half-written model where a loader looks."""
    out = Path(out).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield work
        os.chmod(work, 0o755)
        if out.exists():  # swapped aside, then dropped
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / "d")
            os.replace(work, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(work, out)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def save_model(model: PreTrainedModel, dest: Path, marker: dict[str, Any], *others: Any) -> None:
    """Weights (safetensors), ``others`` (a processor or tokenizer), then the marker file that
    makes the loader treat the directory as the project's own tiny model."""
    with _quiet_progress():
        model.save_pretrained(dest, safe_serialization=True)
        for other in others:
            other.save_pretrained(dest)
    (dest / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
