"""Small classes the CLI tests plug into the stage chain by dotted path."""

import torch


class FirstTokenSampler:
    """Always picks token 0: proves a user class can replace the sampler from the command line."""

    def __init__(self, **_: object) -> None:
        pass

    def __call__(self, logits: torch.Tensor, previous_ids: torch.Tensor | None = None) -> torch.Tensor:
        return torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)


class RefusingStage:
    """A stage that refuses its input with ValueError, as the library's own stages do."""

    def __init__(self, **_: object) -> None:
        pass

    def __call__(self, ctx):
        raise ValueError("RefusingStage: this context is not what I expected")


# --- engine phases a user subclasses (tests/test_stage_hooks.py) -----------------------------
from stages import DecodeLoop, Prefill, Sampler  # noqa: E402


class EvenTokenSampler(Sampler):
    """Greedy over even token ids only: a ``Sampler`` subclass under greedy settings, which the
    engine must call on its rows instead of argmaxing them."""

    def __call__(self, logits: torch.Tensor, previous_ids=None) -> torch.Tensor:
        scores = logits.float().clone()
        scores[..., 1::2] = float("-inf")
        return scores.argmax(dim=-1)


class StopAfterTwo(DecodeLoop):
    """``on_token``: stops every sequence after its second token."""

    def on_token(self, ctx, token_id: int) -> bool:
        return len(ctx.generated) >= 2


class ThreeTokenChunks(Prefill):
    """``plan_chunk``: prefill three tokens per forward, recording what the engine asked."""

    def __init__(self, chunk_size=None) -> None:
        super().__init__(chunk_size)
        self.asked: list[tuple[int, int]] = []

    def plan_chunk(self, ctx, start: int, todo: int) -> int:
        self.asked.append((start, todo))
        return min(todo, 3)


class CallPrefill(Prefill):
    """Overrides ``__call__``, which the engine never calls: refused before the model loads."""

    def __call__(self, ctx):
        return ctx
