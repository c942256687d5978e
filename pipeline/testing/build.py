"""Writing a tiny model directory (``build_tiny``) and the on-disk cache (``tiny_model_dir``).

Why: tests and benchmarks need a real ``from_pretrained`` directory, built
deterministically (seeded weights) and atomically (``os.replace``), so concurrent first uses
and interrupted builds never leave a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging as hf_logging

from pipeline.testing.common import MARKER_FILE, RECIPE_VERSION, _generation_config
from pipeline.testing.registry import family_module
from pipeline.testing.tokenizer import make_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin


def make_processor(family: str, tokenizer: PreTrainedTokenizerBase | None = None) -> ProcessorMixin | None:
    """The family's real processor around ``tokenizer`` (None for text-only families).

    Why: the pipeline's media stages must see exactly what transformers' processors produce
    (patch grids, placeholder expansion, mel features).  VL image/video processors get small
    pixel budgets so images stay a handful of tokens.
    """
    build = getattr(family_module(family), "make_processor", None)  # text-only families have none
    if build is None:
        return None
    tokenizer = tokenizer if tokenizer is not None else make_tokenizer(family)
    return build(tokenizer)


def _make_config(family: str, tok: PreTrainedTokenizerBase) -> PretrainedConfig:
    return family_module(family).make_config(tok)


def _model_class(family: str) -> type[PreTrainedModel]:
    return family_module(family).model_class()


def _write(family: str, seed: int, dest: Path) -> None:
    tok = make_tokenizer(family)
    config = _make_config(family, tok)
    with _seeded(torch, seed):
        model = _model_class(family)(config)
    model.eval()
    _mute_added_tokens(model, tok)
    model.generation_config = _generation_config(family_module(family).ROLES, tok)
    processor = make_processor(family, tok)
    with _quiet_progress():
        model.save_pretrained(dest, safe_serialization=True)
        (processor if processor is not None else tok).save_pretrained(dest)
    marker = {
        "family": family,
        "seed": seed,
        "recipe_version": RECIPE_VERSION,
        "note": "random weights built by mm-pipeline; outputs are meaningless",
    }
    (dest / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _mute_added_tokens(model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> None:
    """Zero the output rows of added tokens (EOS, role and media markers, <think>).

    Why: with random weights any token is a plausible argmax; a greedy run that emitted EOS
    or <|image_pad|> after two steps would make token-count tests depend on the prompt.
    With zero rows their logit is exactly 0 while the best ordinary token's is several
    units above, so greedy never picks them; sampling still can, rarely (about 1% a step
    at temperature 1).  Tests that need an EOS should configure one explicitly.
    """
    ids = sorted(set(tok.get_added_vocab().values()))
    with torch.no_grad():
        model.get_output_embeddings().weight[ids] = 0.0


class _quiet_progress:
    """Hide transformers' per-save progress bars (they would land on the CLI's stderr)."""

    def __enter__(self):
        self.was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        if self.was:
            hf_logging.enable_progress_bar()


class _seeded:
    """Seed torch's CPU generator for the build and restore the caller's RNG state after."""

    def __init__(self, torch, seed: int):
        self.torch, self.seed = torch, seed

    def __enter__(self):
        self.state = self.torch.random.get_rng_state()
        self.torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        self.torch.random.set_rng_state(self.state)


def build_tiny(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny ``family`` model (config, weights, tokenizer/processor) to ``out_dir``.

    Why: gives tests and benchmarks a real ``from_pretrained`` directory.  Weights
    are seeded, so building twice gives byte-identical safetensors.  The directory is built
    next to ``out_dir`` and moved into place with ``os.replace``, so no process ever sees a
    half-written model; an existing ``out_dir`` is replaced.
    """
    family_module(family)
    out = Path(out_dir).expanduser().absolute()
    _build_into(family, seed, out, keep_existing=False)
    return out


def _build_into(family: str, seed: int, dest: Path, keep_existing: bool) -> None:
    """Build privately next to ``dest``, then move the directory into place with ``os.replace``.

    When ``dest`` already exists (not empty), it is swapped aside and dropped, unless
    ``keep_existing`` and it is a complete build (a concurrent builder won the race).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        _write(family, seed, tmp)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (keep_existing and _is_complete(dest)):
                old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
                os.replace(dest, old / "d")
                os.replace(tmp, dest)
                shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _cache_root() -> Path:
    env = os.environ.get("MM_PIPELINE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mm-pipeline"


def _is_complete(d: Path) -> bool:
    try:
        marker = json.loads((d / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe_version") == RECIPE_VERSION and (d / "model.safetensors").is_file()


def tiny_model_dir(family: str) -> Path:
    """Cached tiny model for ``family`` (built on first use, reused afterwards).

    Lives in ``$MM_PIPELINE_HOME/tiny-<family>-v<N>`` or ``~/.cache/mm-pipeline/...``.
    Concurrent first uses are safe: each builds privately and the first rename wins.
    """
    family_module(family)
    d = _cache_root() / f"tiny-{family}-v{RECIPE_VERSION}"
    if not _is_complete(d):
        _build_into(family, 0, d, keep_existing=True)  # a broken leftover is replaced
    return d
