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
