"""bitsandbytes quantisation, accelerate placement and the KV memory guard (issue 5).

Everything runs on CPU: bitsandbytes >= 0.49 has CPU 4-bit and int8 kernels, and the tiny
models keep every Linear at in_features >= 64 (the CPU 4-bit path's floor).
"""

from __future__ import annotations

import json
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import generate_oracle, image_chat_inputs, run_cli
from pipeline import Pipeline, Request, UserError, load_model
from pipeline.memory import kv_bytes
from pipeline.metrics import decode_weight_bytes
from pipeline.model.quant import quantization_config, scheme_name
from stages import DecodeLoop, Prefill, Sampler, Tokenize

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
N = 10
PROMPT = "Tell me about the sea."


def make_pipe(lm) -> Pipeline:
    return Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(Sampler())})


def run_and_oracle(lm, max_new_tokens: int = N) -> tuple[list[int], list[int]]:
    result = make_pipe(lm).run(Request(prompt=PROMPT, max_new_tokens=max_new_tokens))
    ids = torch.tensor([result.prompt_ids], device=lm.device)
    return result.token_ids, generate_oracle(lm, ids, max_new_tokens)


def linears(model, cls) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m) is cls]


# --- greedy output equals generate on the same quantised model --------------------------------
@pytest.mark.parametrize("scheme", ["nf4", "int8", "int8wo"])
def test_quantised_pipeline_matches_generate(load_tiny, scheme):
    lm = load_tiny("qwen3", quant=scheme)
    assert lm.quant == scheme
    ours, oracle = run_and_oracle(lm)
    assert ours == oracle
    result = make_pipe(lm).run(Request(prompt=PROMPT, max_new_tokens=2))
    assert result.metrics["quant"] == scheme
    assert result.metrics["weights_bytes"] == lm.weights_bytes == sum(sum(k.values()) for k in lm.placement.values())
    assert result.metrics["placement"] == lm.placement


@pytest.mark.skipif(not torch.cuda.is_available(), reason="int4wo runs on CUDA only")
def test_int4wo_pipeline_matches_generate_on_cuda(load_tiny):
    """torchao's int4 weights in the tile-packed layout (PyTorch's own tinygemm kernel, bfloat16)."""
    lm = load_tiny("qwen3", quant="int4wo", dtype=torch.bfloat16)
    assert lm.quant == "int4wo"
    assert type(lm.model.model.layers[0].mlp.up_proj.weight).__name__ == "Int4TilePackedTo4dTensor"
    ours, oracle = run_and_oracle(lm)
    assert ours == oracle


# --- the layers really are 4-bit / 8-bit, and the skip list is honoured -----------------------
def test_nf4_linears_are_4bit_and_skips_stay_linear(load_tiny):
    # double_quant off: its per-layer code table (1 KiB) would dominate layers this small
    lm = load_tiny("qwen3", quant={"name": "nf4", "skip_modules": ["lm_head", "mlp"], "double_quant": False})
    model = lm.model
    quantised = linears(model, bnb.nn.Linear4bit)
    assert {n.rsplit(".", 1)[-1] for n, _ in quantised} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for _, module in quantised:
        assert type(module.weight).__name__ == "Params4bit" and module.weight.quant_type == "nf4"
        # two 4-bit weights per stored byte
        assert module.weight.numel() * module.weight.element_size() * 2 == module.in_features * module.out_features
    plain = {n for n, _ in linears(model, torch.nn.Linear)}
    assert "lm_head" in plain and all(f"mlp.{p}" in " ".join(plain) for p in ("gate_proj", "up_proj", "down_proj"))
    # Placement: nf4 bytes ~ half a byte per quantised weight (plus per-block scales), the rest float32.
    n_quantised = sum(m.in_features * m.out_features for _, m in quantised)
    float_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if type(p).__name__ != "Params4bit")
    float_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    assert set(lm.placement) == {str(lm.device)}
    assert lm.placement[str(lm.device)]["float32"] == float_bytes
    # 4 bits per weight + one float32 absmax per 64-weight block = 0.5625 bytes per weight
    assert 0.5625 <= lm.placement[str(lm.device)]["nf4"] / n_quantised < 0.57


def test_default_skips_keep_lm_head_and_quantise_every_decoder_linear(load_tiny):
    lm = load_tiny("qwen3", quant="nf4")
    plain = [n for n, _ in linears(lm.model, torch.nn.Linear)]
    assert plain == ["lm_head"]
    assert len(linears(lm.model, bnb.nn.Linear4bit)) == 7 * lm.config.num_hidden_layers


def test_nf4_vision_model_keeps_its_tower_unquantised_and_matches_generate(load_tiny):
    from PIL import Image

    from stages.vision_encoder import VisionEncoder

    lm = load_tiny("qwen2-vl", quant="nf4")
    plain = [n for n, _ in linears(lm.model, torch.nn.Linear)]
    four_bit = [n for n, _ in linears(lm.model, bnb.nn.Linear4bit)]
    assert plain and all(n.startswith("model.visual.") or n == "lm_head" for n in plain)
    assert any(".merger." in n for n in plain)  # the projector into the LM stays unquantised too
    assert four_bit and all(n.startswith("model.language_model.") for n in four_bit)
    image = Image.fromarray((torch.arange(112 * 112 * 3) % 251).to(torch.uint8).reshape(112, 112, 3).numpy(), "RGB")
    pipe = Pipeline(
        lm,
        {
            "tokenize": Tokenize(),
            "vision_encoder": VisionEncoder(),
            "prefill": Prefill(),
            "decode": DecodeLoop(Sampler()),
        },
    )
    result = pipe.run(Request(prompt="What is it?", images=[image], max_new_tokens=N, ignore_eos=True))
    ids, inputs = image_chat_inputs(lm, [image], "What is it?")
    assert result.prompt_ids == ids[0].tolist()
    assert result.token_ids == generate_oracle(lm, ids, N, ignore_eos=True, **inputs)


def test_int8wo_weights_are_torchao_int8_with_row_scales_and_skips_stay_plain(load_tiny):
    lm = load_tiny("qwen3", quant="int8wo")
    layer = lm.model.model.layers[0].mlp.up_proj
    assert type(layer.weight).__name__ == "Int8Tensor"
    assert layer.weight.qdata.dtype == torch.int8 and layer.weight.scale.numel() == layer.out_features
    assert type(lm.model.lm_head.weight).__name__ == "Int8Tensor"  # int8wo's default: the output projection too
    kept = load_tiny("qwen3", quant={"name": "int8wo", "skip_modules": ["lm_head"]})
    assert type(kept.model.lm_head.weight) is torch.nn.Parameter
    assert type(kept.model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    linear_bytes = sum(
        m.in_features * m.out_features + 5 * m.out_features
        for m in lm.model.modules()
        if type(getattr(m, "weight", None)).__name__ == "Int8Tensor"
    )
    assert (
        lm.placement[str(lm.device)]["int8wo"] == linear_bytes
    )  # int8 weights, a float32 scale and an int8 zero per row
    # what a decode step reads (the bandwidth figure) counts the int8 bytes, not the logical float32 ones
    plain = load_tiny("qwen3")
    int8 = [m for m in lm.model.modules() if type(getattr(m, "weight", None)).__name__ == "Int8Tensor"]
    saved = sum(4 * m.in_features * m.out_features for m in int8) - linear_bytes
    assert decode_weight_bytes(lm.model) == decode_weight_bytes(plain.model) - saved


def test_int8_placement_counts_weights_and_row_scales(load_tiny):
    lm = load_tiny("qwen3", quant="int8")
    quantised = linears(lm.model, bnb.nn.Linear8bitLt)
    assert quantised and all(type(m.weight).__name__ == "Int8Params" for _, m in quantised)
    # one int8 byte per weight + one float32 scale per output row
    expected = sum(m.in_features * m.out_features + 4 * m.out_features for _, m in quantised)
    assert lm.placement[str(lm.device)]["int8"] == expected


def test_skip_names_match_towers_anywhere_at_module_boundaries():
    """Bare names in quant.skip_modules reach nested towers (transformers anchors at the start)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from pipeline.families.qwen2_audio import Qwen2AudioFamily
    from pipeline.families.qwen2_vl import Qwen2VLFamily

    encoders = Qwen2VLFamily.encoder_modules + Qwen2AudioFamily.encoder_modules
    patterns = quantization_config({"name": "nf4"}, encoders=encoders).llm_int8_skip_modules
    kept = [
        "lm_head",
        "model.visual.blocks.0.attn.qkv",
        "model.visual.merger.mlp.0",
        "audio_tower.layers.0.fc1",
        "model.multi_modal_projector.linear",
    ]
    converted = [
        "model.language_model.layers.0.mlp.up_proj",
        "model.layers.1.self_attn.q_proj",
        "model.visual_proj",
        "model.layers.0.lm_head_gate",
    ]
    assert not any(should_convert_module(name, patterns) for name in kept)
    assert all(should_convert_module(name, patterns) for name in converted)


def test_tied_lm_head_is_never_quantised():
    config = quantization_config({"name": "nf4", "skip_modules": []}, tied_lm_head=True)
    assert any("lm_head" in p for p in config.llm_int8_skip_modules)
    assert quantization_config({"name": "nf4", "skip_modules": []}).llm_int8_skip_modules == []
    tied = quantization_config({"name": "int8wo"}, tied_lm_head=True)  # int8wo's default would quantise it
    assert any("lm_head" in p for p in tied.modules_to_not_convert)
    assert not any("lm_head" in p for p in quantization_config({"name": "int8wo"}).modules_to_not_convert)


# --- accelerate placement: offloaded weights count where they live ----------------------------
def test_disk_offloaded_weights_are_reported_on_disk_and_output_unchanged(load_tiny, tiny_dir, tmp_path):
    reference = load_tiny("qwen3")
    lm = load_model(
        str(tiny_dir("qwen3")), device_map={"model": "cpu", "lm_head": "disk"}, offload_folder=str(tmp_path / "offload")
    )
    head = reference.model.lm_head.weight
    assert lm.placement["disk"] == {"float32": head.numel() * 4}
    assert "meta" not in lm.placement
    assert lm.weights_bytes == reference.weights_bytes
    ours = make_pipe(lm).run(Request(prompt=PROMPT, max_new_tokens=N)).token_ids
    assert ours == make_pipe(reference).run(Request(prompt=PROMPT, max_new_tokens=N)).token_ids


# --- KV cache arithmetic and the guard ---------------------------------------------------------
def test_kv_arithmetic_equals_the_real_cache(load_tiny):
    lm = load_tiny("qwen3")
    pipe = make_pipe(lm)
    cache = pipe.new_cache()
    result = pipe.run(Request(prompt=PROMPT, max_new_tokens=N, ignore_eos=True), cache=cache)
    text = lm.config
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 4
    # the last generated token is never fed back, so the cache holds prompt + N - 1, in whole blocks
    held = len(result.prompt_ids) + N - 1
    tokens = -(-held // cache.block_size) * cache.block_size
    assert cache.length == held
    assert cache.nbytes == kv_bytes(lm.config, tokens, torch.float32) == per_token * tokens


def test_kv_arithmetic_reads_the_text_config_of_multimodal_models():
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=1000
        )
    )
    # Qwen2-VL-2B: 28 layers x 2 kv heads x 128 dims x (k, v) x 2 bytes = 28 KiB per token in bfloat16
    assert kv_bytes(config, 1000, torch.bfloat16) == 28 * 2 * 128 * 2 * 2 * 1000


def test_kv_pool_is_sized_from_the_memory_budget_and_long_requests_are_refused(tiny_dir):
    probe = load_model(str(tiny_dir("qwen3")), device_map="cpu")
    weights = probe.weights_bytes
    budget = 256 * 1024
    lm = load_model(str(tiny_dir("qwen3")), device_map="cpu", max_memory={"cpu": weights + budget})
    assert lm.max_memory == {"cpu": weights + budget}
    pipe = make_pipe(lm)
    block = kv_bytes(lm.config, 16, torch.float32)
    assert pipe.pool.num_blocks - 1 == budget // 4 // block  # auto: a quarter of what the budget leaves
    with pytest.raises(UserError) as err:
        pipe.run(Request(prompt=PROMPT, max_new_tokens=1000))
    message = str(err.value)
    prompt = len(pipe.tokenize(Request(prompt=PROMPT)).input_ids[0])
    assert "\n" not in message
    assert f"needs {prompt + 999} tokens of KV cache" in message and f"holds {pipe.pool.capacity_tokens}" in message
    assert pipe.pool.used_blocks == 0  # nothing was allocated
    # the same budget is plenty for a short answer
    assert len(pipe.run(Request(prompt=PROMPT, max_new_tokens=4, ignore_eos=True)).token_ids) == 4


def test_kv_pool_uses_the_free_memory_of_the_device(load_tiny, monkeypatch):
    import pipeline.kv.sizing as sizing

    lm = load_tiny("qwen3")
    block = kv_bytes(lm.config, 16, torch.float32)
    monkeypatch.setattr(sizing, "free_bytes", lambda device, lm: (10 * block, "free on test device"))
    assert sizing.pool_for(lm, 0.5).capacity_tokens == 5 * 16
    assert sizing.pool_for(lm, 3 * block).capacity_tokens == 3 * 16
    with pytest.raises(UserError, match=rf"kv.memory={11 * block:,} bytes is more than .* free on cpu"):
        sizing.pool_for(lm, 11 * block)
    with pytest.raises(UserError, match="not even one KV block"):
        sizing.pool_for(lm, 0.05)
    with pytest.raises(UserError, match="kv.memory must be auto, a number of bytes, or a fraction"):
        sizing.pool_for(lm, 2.5)  # the same check as the CLI's kv.memory


# --- the quant config group ---------------------------------------------------------------------
def compose_quant(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=list(overrides)).quant


@pytest.mark.parametrize("scheme", ["none", "auto", "nf4", "fp4", "int8", "int8wo", "int4wo"])
def test_every_quant_yaml_composes_and_is_valid(scheme):
    quant = compose_quant(f"quant={scheme}")
    assert scheme_name(quant) == scheme
    if scheme not in ("none",):
        assert quant.skip_modules is None  # lm_head + the family's encoders, decided at load


def test_auto_leaves_tiny_models_unquantised_on_cpu(load_tiny):
    assert load_tiny("qwen3", quant="auto").quant == "none"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["quant.name=q3"], "unknown quant scheme 'q3'"),
        (["quant=int8", "quant.quant_type=fp4"], "int8 and fp4 are two different schemes"),
        (["quant=nf4", "quant.quant_type=fp4"], "use quant=fp4"),
        (["quant=none", "quant.quant_type=nf4"], "needs a 4-bit scheme"),
        (["quant=nf4", "quant.compute_dtype=int3"], "unknown quant.compute_dtype 'int3'"),
        (["quant=nf4", "quant.skip_modules=[lm head]"], "not a module name"),
        (["quant=int8wo", "quant.quant_type=nf4"], "int8wo and nf4 are two different schemes"),
        pytest.param(
            ["quant=int4wo"],
            "quant=int4wo needs a CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="int4wo is refused where there is no GPU"),
        ),
    ],
)
def test_bad_quant_settings_are_one_line_errors(overrides, message):
    with pytest.raises(UserError, match=message) as err:
        quantization_config(compose_quant(*overrides))
    assert "\n" not in str(err.value)


def test_a_quant_setting_of_the_wrong_type_is_refused_while_composing():
    """The settings schema types the quant group: the CLI reports Hydra's error in one line."""
    from hydra.errors import ConfigCompositionException

    from pipeline.__main__ import one_line

    with pytest.raises(ConfigCompositionException) as err:
        compose_quant("quant=int8", "quant.threshold=high")
    assert one_line(err.value) == ("quant.threshold=high: Value 'high' of type 'str' could not be converted to Float")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(offload_folder="FILE/sub"), "model.offload_folder .* cannot be written"),
        (dict(max_memory={"cpu": "lots"}), r"model.max_memory\['cpu'\]='lots' is not a size"),
        (dict(max_memory={"gpu0": "1GiB"}), "model.max_memory key 'gpu0' is not a device"),
        (dict(device_map="warp:0"), "model.device_map 'warp:0' is not a device"),
        (dict(quant="nf4", device_map={"model": "cpu", "lm_head": "disk"}), "cannot offload layers to disk"),
    ],
)
def test_bad_placement_settings_fail_before_loading(tiny_dir, tmp_path, kwargs, message):
    if kwargs.get("offload_folder") == "FILE/sub":
        (tmp_path / "FILE").write_text("a file, not a folder")
        kwargs = dict(offload_folder=str(tmp_path / "FILE" / "sub"))
    if "disk" in str(kwargs.get("device_map")) and torch.cuda.is_available():
        pytest.skip("disk offload next to a GPU is allowed (offloaded layers stay unquantised)")
    with pytest.raises(UserError, match=message) as err:
        load_model(str(tiny_dir("qwen3")), **kwargs)
    assert "\n" not in str(err.value)


# --- end to end: one sweep compares schemes; bad input exits 2 with one line --------------------
@pytest.mark.slow
def test_cli_sweep_reports_each_scheme_in_its_result(tiny_dir, tmp_path):
    proc = run_cli(
        "-m",
        "quant=nf4,int8",
        f"model.path={tiny_dir('qwen3')}",
        "max_new_tokens=3",
        "metrics_table=false",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for job, scheme in (("0", "nf4"), ("1", "int8")):
        result = json.loads((tmp_path / job / "result.json").read_text())
        metrics = result["metrics"]
        assert metrics["quant"] == scheme
        assert set(metrics["placement"]["cpu"]) == {"float32", scheme}
        assert metrics["weights_bytes"] == sum(metrics["placement"]["cpu"].values())
        assert f"weights (quant={scheme}):" in proc.stderr
    assert "Failed to load CPU gemm_4bit" not in proc.stderr and "MatMul8bitLt" not in proc.stderr


@pytest.mark.slow  # suite time; in-process: test_quant's contradicting-settings cases
def test_cli_int8_with_fp4_exits_2_with_one_line(tiny_dir, tmp_path):
    proc = run_cli(f"model.path={tiny_dir('qwen3')}", "quant=int8", "quant.quant_type=fp4", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: quant=int8 with quant.quant_type=fp4")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
