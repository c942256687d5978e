"""How a step calls the model: the decoder and the output projection, with as little around
them as the model allows.

The top-level forward of a multimodal model is two wrappers around its decoder, each building an
output object, and the decoder's forward is itself wrapped by transformers' decorators (merging
config defaults, capturing hidden states and attentions, renaming deprecated keywords). At
small size a decode step is bound by Python, not arithmetic: calling the decoder and the
projection directly, and the decoder's undecorated forward when nothing needs the wrappers,
makes the eager step about 10% faster with the same arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as nn_module

from pipeline.memory import text_config

# Decorators on a decoder's forward that do nothing a paged step needs: config defaults for
# arguments the step passes, output capture it never asks for, renamed keywords it never uses.
BOOKKEEPING = ("merge_with_config_defaults.", "capture_outputs.", "deprecate_kwarg.")


def plain_head(model: torch.nn.Module) -> tuple["DecoderCall", torch.nn.Module] | None:
    """(decoder, output projection) when the model's logits are just the projection of the
    decoder's hidden states (no soft-capping or scaling in between), else None."""
    text = text_config(model.config)
    if getattr(text, "final_logit_softcapping", None) is not None or getattr(text, "logit_scale", None) is not None:
        return None
    if getattr(text, "logits_scaling", 1.0) != 1.0:
        return None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is model:
        return None
    return DecoderCall(decoder), head


class DecoderCall:
    """Calls the decoder: its undecorated forward when every decorator is bookkeeping
    (``BOOKKEEPING``), its config sets no ``is_causal`` (a default one of them merges) and
    nothing hooks the module (hooks of users, tests or accelerate's placement); otherwise the
    module as usual. The hooks are checked at every call: they may come and go."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.decoder = decoder
        self.bare = _undecorated(type(decoder).forward)
        if getattr(decoder.config, "is_causal", None) is not None:
            self.bare = None

    def __call__(self, **kwargs: Any) -> Any:
        d = self.decoder
        if self.bare is None or d._forward_hooks or d._forward_pre_hooks or hasattr(d, "_hf_hook") or _global_hooks():
            return d(**kwargs)
        return self.bare(d, **kwargs)


def _undecorated(forward: Any) -> Any:
    """The function under ``forward``'s decorators if they are all bookkeeping, else None."""
    while hasattr(forward, "__wrapped__"):
        name = getattr(getattr(forward, "__code__", None), "co_qualname", "")  # (Python 3.11+)
        if not name.startswith(BOOKKEEPING):
            return None
        forward = forward.__wrapped__
    return forward


def _global_hooks() -> bool:
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
