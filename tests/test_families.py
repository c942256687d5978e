"""Which architectures run: a model no family covers runs as a generic text model only when its
layers are plain attention; anything else is refused in one line before its weights load."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, JambaConfig, Lfm2Config, Llama4TextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from conftest import run_cli

SIZES = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "make, arch, kind",
    [
        # transformers names Jamba's Mamba layers linear_attention, as it does Qwen3.5's Gated
        # DeltaNet: only a family that knows the layer (qwen3.5) runs it, the generic text one never
        # both through the CLI, slow (suite time): the refusal itself is checked in-process below
        pytest.param(lambda: JambaConfig(**SIZES), "JambaForCausalLM", "linear_attention", marks=pytest.mark.slow),
        pytest.param(
            lambda: Llama4TextConfig(**SIZES), "Llama4ForCausalLM", "chunked_attention", marks=pytest.mark.slow
        ),
    ],
)
def test_unknown_architecture_with_other_layers_is_refused_in_one_line(tmp_path, make, arch, kind):
    config = make()
    config.architectures = [arch]
    config.save_pretrained(tmp_path)  # no weights: the refusal comes before they would load
    proc = run_cli(f"model.path={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert arch in lines[0] and kind in lines[0] and "qwen2-vl" in lines[0] and "qwen2-audio" in lines[0]


def test_linear_attention_runs_only_through_the_family_that_declares_it():
    """Qwen3.5's text config has Gated DeltaNet layers: its own family runs it, while the same
    layers under a model type no family covers are refused before any weights load, as are
    LFM2's convolution layers."""
    from pipeline.errors import UserError
    from pipeline.families import family_for_config

    config = Qwen3_5TextConfig(**SIZES)
    assert "linear_attention" in config.layer_types and family_for_config(config).name == "qwen3.5-text"
    config.model_type = "not_a_known_type"
    with pytest.raises(UserError, match="its linear_attention layers are not full or sliding-window attention"):
        family_for_config(config)
    with pytest.raises(UserError, match="^Lfm2ForCausalLM is not supported: its conv layers"):
        family_for_config(Lfm2Config(**SIZES, full_attn_idxs=[1, 3], architectures=["Lfm2ForCausalLM"]))


def test_attention_that_soft_caps_its_logits_is_refused_before_the_weights_load():
    """Gemma 2 soft-caps its attention logits, which the paged attention does not: refused at
    load in one line (a server once started and answered every request with a 500)."""
    from pipeline.errors import UserError
    from pipeline.families import family_for_config

    config = Gemma2Config(**SIZES, architectures=["Gemma2ForCausalLM"])
    with pytest.raises(UserError, match=r"^Gemma2ForCausalLM is not supported: .*attn_logit_softcapping=50.0"):
        family_for_config(config)
    config.attn_logit_softcapping = None  # the same model without it runs
    assert family_for_config(config).name == "text"


def test_unknown_architecture_with_plain_attention_runs_as_text(load_tiny):
    lm = load_tiny("qwen3")  # qwen3 has no family file: the generic text family runs it
    assert lm.family.name == "text" and not lm.family.media


def test_a_family_is_found_from_its_file_alone(tmp_path, monkeypatch):
    """Adding a family is adding its module under families/: the registry finds it there."""
    import pipeline.families as families
    from transformers import LlamaConfig

    (tmp_path / "tinyllama_test_family.py").write_text(
        "from pipeline.families.base import TextFamily\n\n\n"
        "class TestLlamaFamily(TextFamily):\n"
        "    name = 'test-llama'\n"
        "    model_types = ('llama',)\n"
    )
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    assert families.registry()["qwen2_vl"].name == "qwen2-vl"
    assert families.family_for_config(LlamaConfig()).name == "test-llama"


def test_sliding_window_layers_run_as_text_when_no_family_covers_them():
    """The paged pool holds sliding-window layers (every position kept, the window masked)."""
    from transformers import Qwen2Config

    from pipeline.families import family_for_config
    from pipeline.memory import sliding_window

    config = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert family_for_config(config).name == "text" and sliding_window(config) == 64
