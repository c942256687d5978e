"""What a transformers model's own code says about its prompt's attention and positions, asked of
that code rather than written down per model (issue 48: the generic vision family).

- ``attention_blocks``: the spans a prompt attends both ways during prefill. Models whose mask
  depends on ``token_type_ids`` (PaliGemma's prefix, Gemma 3's image blocks) build it in their
  ``create_masks_for_generate``; it is called on the prompt's token types and read back as causal
  plus square blocks, the shape the paged attention applies (anything else is refused).
- ``position_offset``: where the model's positions start. PaliGemma's are 1-indexed: its
  ``prepare_inputs_for_generation`` adds 1 to the positions ``generate()`` computes.
"""

from __future__ import annotations

import copy
import inspect

import torch

from pipeline.errors import UserError


def takes_token_types(cls: type) -> bool:
    """Whether ``cls`` builds its prefill mask from ``token_type_ids`` (its ``create_masks_for_generate``
    takes them)."""
    method = getattr(cls, "create_masks_for_generate", None)
    return method is not None and "token_type_ids" in inspect.signature(method).parameters


def attention_blocks(model: torch.nn.Module, types: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each span of the prompt whose tokens see each other, from the model's own
    prefill mask for token types ``types`` [1, L]."""
    length = types.shape[-1]
    config = copy.deepcopy(model.config)
    config._attn_implementation = "sdpa"  # a boolean mask (None where plainly causal)
    mask = type(model).create_masks_for_generate(
        config=config,
        inputs_embeds=torch.zeros(1, length, 1),
        attention_mask=torch.ones(1, length, dtype=torch.long),
        cache=None,
        position_ids=torch.arange(length).view(1, -1),
        token_type_ids=types.cpu(),
        is_first_iteration=True,
    )
    if isinstance(mask, dict):  # full and sliding-window layers: the window is the paged attention's own rule
        mask = mask.get("full_attention", next(iter(mask.values())))
    if mask is None:
        return []
    return blocks_of(mask.reshape(length, length).to(torch.bool))


def blocks_of(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The square blocks that, or-ed with the causal mask, make ``mask`` [L, L] (True: attends).
    Lean on memory (a prompt's mask is L x L): two more L x L temporaries at most."""
    length = mask.shape[0]
    if int(mask.tril().sum()) != length * (length + 1) // 2:
        raise UserError("this model's prefill mask hides earlier tokens, which the paged attention does not")
    ahead = mask.triu(1)
    seen = ahead.any(1)
    last = torch.where(seen, length - 1 - ahead.flip(1).to(torch.int8).argmax(1), torch.arange(length)).tolist()
    blocks, q = [], 0
    while q < length:
        if last[q] > q:
            blocks.append((q, last[q] + 1))
            q = last[q] + 1
        else:
            q += 1
    # causal plus exactly these blocks: each block's upper triangle full, nothing ahead outside them
    full = all(bool(ahead[a:b, a:b].triu(1).sum() == (b - a) * (b - a - 1) // 2) for a, b in blocks)
    if not full or int(ahead.sum()) != sum((b - a) * (b - a - 1) // 2 for a, b in blocks):
        raise UserError(
            "this model's prefill mask is not causal plus blocks attended both ways, which is what the "
            "paged attention applies"
        )
    return blocks


def position_offset(model: torch.nn.Module) -> int:
    """What the model adds to ``generate()``'s positions (1 for PaliGemma's 1-indexed ones, else 0)."""
    ids = torch.zeros(1, 2, dtype=torch.long)
    positions = torch.arange(2).view(1, -1)
    try:
        inputs = model.prepare_inputs_for_generation(
            ids, position_ids=positions, cache=None, attention_mask=torch.ones_like(ids)
        )
    except Exception:  # noqa: BLE001 - a model whose preparation wants more: positions as generate() makes them
        return 0
    given = inputs.get("position_ids")
    if not isinstance(given, torch.Tensor) or given.shape != positions.shape:
        return 0
    shift = (given.cpu() - positions).unique()
    return int(shift[0]) if shift.numel() == 1 else 0
