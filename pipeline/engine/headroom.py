"""``kv.memory=auto`` on a GPU: the memory a step needs besides weights and pool, measured.

The estimate from the configs (``kv.sizing.activation_headroom``) can miss either way: kernels
that allocate workspaces, a vision tower's own attention, the allocator's rounding. So before the
pool is sized, a prefill-only copy of the chain runs once on a pool just big enough for it
(``Pipeline.scratch``): the largest image the processor lets through and 30 s of audio (where the
chain has those encoders), a lone ``max_batch_tokens`` prompt, and ``max_seqs`` prompts packed
into one step of ``max_batch_tokens`` tokens. The device's peak over that run, less what it held
before and the scratch pool, times ``MARGIN``, is kept free; the scratch pipeline is dropped
before the real pool is sized.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from PIL import Image

from pipeline.context import Request
from pipeline.errors import UserError
from pipeline.kv import sizing
from pipeline.memory import fmt_bytes, release_cached_memory

MARGIN = 1.2  # over the measured peak: allocator fragmentation, steps the warm-up does not hit exactly
TEXT = " the pool is sized after this warm-up"  # filler prompt text (a real tokenizer's ordinary tokens)


class CudaMeter:
    """Peak bytes the CUDA caching allocator handed out since ``start``, beyond what it held then."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        release_cached_memory(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def held(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def meter_for(device: torch.device) -> CudaMeter | None:
    """What measures a warm-up on ``device``: CUDA's allocator statistics; None elsewhere (a CPU
    pool's pages are touched only as blocks are used, so ``auto`` needs no headroom there)."""
    return CudaMeter(device) if device.type == "cuda" else None


def measured_headroom(pipe: Any) -> tuple[int, str] | None:
    """(bytes, what for) to keep free besides ``pipe``'s pool under ``kv.memory=auto``, measured
    by a warm-up run (module docstring); None where nothing is measured (not ``auto``, not CUDA)."""
    lm = pipe.lm
    meter = meter_for(sizing.pool_device(lm)) if sizing.kv_memory_setting(pipe.kv_memory) == "auto" else None
    if meter is None:
        return None
    media = _largest_media(pipe)
    tokens = max([pipe.max_batch_tokens] + [bound for _, bound in media]) + 2 * pipe.max_seqs * pipe.kv_block_size
    meter.start()
    scratch = pipe.scratch(
        sizing.pool_bytes_for(
            lm, tokens, pipe.kv_block_size, pipe.kv_state_checkpoint_every, pipe.max_seqs, pipe.kv_dtype
        )
    )
    pool = meter.held()
    try:
        for request, _ in media:
            scratch.run(request)
        _prefill_steps(scratch)
        peak = max(meter.peak() - pool, 0)
    except torch.OutOfMemoryError as err:
        raise UserError(
            f"kv.memory=auto: the warm-up that measures a step's memory ran out of it "
            f"({str(err).splitlines()[0][:120]}): lower engine.max_batch_tokens or the largest "
            f"image (the processor's max_pixels), or set kv.memory"
        ) from None
    finally:
        del scratch
        gc.collect()  # the scratch pool and engine refer to each other
        release_cached_memory(meter.device)
    what = [f"a {pipe.max_batch_tokens:,}-token prefill"] + [f"the largest {kind}" for kind in _kinds(media)]
    return int(peak * MARGIN), f"{' and '.join(what)} peaked at {fmt_bytes(peak)} in a warm-up (x{MARGIN} kept)"


def _prefill_steps(scratch: Any) -> None:
    """A lone ``max_batch_tokens`` prompt (one chunk: the fused causal kernel), then ``max_seqs``
    prompts that fill one step together (several chunks: masked attention, a logits row each).
    Each starts with its own token, so none is served from the prefix cache."""
    tokens, rows = scratch.max_batch_tokens, scratch.max_seqs
    filler = scratch.lm.tokenizer(TEXT * (tokens // 4 + 1), add_special_tokens=False)["input_ids"]
    scratch.run_ids(filler[:tokens], Request(max_new_tokens=1))
    share = max(1, tokens // rows)
    handles = [
        scratch.submit(Request(max_new_tokens=1), ids=filler[k + 1 : k + 1 + share], result=False) for k in range(rows)
    ]
    for handle in handles:
        scratch.wait(handle)


def _largest_media(pipe: Any) -> list[tuple[Request, int]]:
    """Requests with the largest input of each encoder the chain has, and a bound on their prompt
    tokens: an image at the processor's pixel cap, a 30 s clip at the audio sampling rate."""
    kinds = {k for stage in pipe.stages.values() for k in getattr(stage, "media_kinds", ())}
    out = []
    patches = sizing.largest_image_patches(pipe.lm)
    if "image" in kinds and patches:
        side = max(1, int(sizing.largest_image_pixels(pipe.lm) ** 0.5))
        image = Image.new("RGB", (side, side), (128, 128, 128))
        out.append((Request(prompt="Describe the picture.", images=[image], max_new_tokens=1), patches + 256))
    extractor = getattr(getattr(pipe.lm, "processor", None), "feature_extractor", None)
    if "audio" in kinds and getattr(extractor, "n_samples", None):
        clip = (torch.zeros(int(extractor.n_samples)), int(extractor.sampling_rate))
        request = Request(prompt="Transcribe.", audios=[clip], max_new_tokens=1)
        out.append((request, int(extractor.n_samples) // 160 + 256))  # 160 samples per mel frame: a bound
    return out


def _kinds(media: list[tuple[Request, int]]) -> list[str]:
    return ["image" if request.images else "audio clip (30 s)" for request, _ in media]
