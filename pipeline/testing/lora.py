"""LoRA adapters made with peft on a saved model, for tests and benchmarks: random non-zero A and
B (``init_lora_weights=False``), so an adapter changes every answer; and peft's merged model,
the oracle an adapter's answers are compared with."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from pipeline.model.quant import quiet_bitsandbytes

quiet_bitsandbytes()  # peft imports bitsandbytes, whose CPU backend alarms at import


def base_model(base_dir: str | Path, **load: Any) -> torch.nn.Module:
    """The model class mm-pipeline loads for this checkpoint, as loaded by ``load_model`` (float32
    unless ``load`` says otherwise): the adapter's module names are the engine's."""
    from pipeline.model.loading import load_model

    return load_model(str(base_dir), **{"dtype": torch.float32, "quant": "none", **load}).model


def make_adapter(
    base_dir: str | Path,
    out: str | Path,
    seed: int,
    targets: Sequence[str] | str = ("q_proj", "v_proj", "down_proj"),
    r: int = 4,
    alpha: int = 8,
    **config: Any,
) -> Path:
    """Save a LoRA adapter for the model at ``base_dir`` into ``out`` (peft's ``save_pretrained``)."""
    import peft

    torch.manual_seed(seed)
    targets = targets if isinstance(targets, str) else list(targets)
    lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config)
    peft.get_peft_model(base_model(base_dir), lora).save_pretrained(str(out))
    return Path(out)


def merged_model(base_dir: str | Path, adapter_dir: str | Path, **load: Any) -> torch.nn.Module:
    """peft's merged model (``merge_and_unload``): the base with every adapter layer folded in."""
    import peft

    return peft.PeftModel.from_pretrained(base_model(base_dir, **load), str(adapter_dir)).merge_and_unload().eval()


def peft_model(base_dir: str | Path, adapter_dir: str | Path, **load: Any) -> torch.nn.Module:
    """peft's unmerged model: ``base(x) + B(A(x)) * scale`` on the base's own (maybe quantised) layers."""
    import peft

    return peft.PeftModel.from_pretrained(base_model(base_dir, **load), str(adapter_dir)).eval()
