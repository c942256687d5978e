"""The tiny models the project builds itself: they load through the real transformers path,
their processors and chat templates behave like the published ones, and builds are
deterministic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import transformers as tf
from pipeline import testing, tiny

MODEL_CLASSES = {
    "qwen3": tf.AutoModelForCausalLM,
    "llama": tf.AutoModelForCausalLM,
    "qwen2-vl": tf.Qwen2VLForConditionalGeneration,
    "qwen2.5-vl": tf.Qwen2_5_VLForConditionalGeneration,
    "qwen2-audio": tf.Qwen2AudioForConditionalGeneration,
    "gemma3": tf.Gemma3ForConditionalGeneration,
    "qwen3-vl": tf.Qwen3VLForConditionalGeneration,
    "qwen2.5-omni": tf.Qwen2_5OmniThinkerForConditionalGeneration,
    "qwen3.5": tf.Qwen3_5ForConditionalGeneration,
    "qwen3.5-text": tf.Qwen3_5ForCausalLM,
}
TEXT = ("qwen3", "llama", "qwen3.5-text")
VISION = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5")
THINK_OFF = "<think>\n\n</think>\n\n"  # what Qwen3.5-0.8B's template adds unless thinking is asked for
GEMMA = ("gemma3",)
OMNI = ("qwen2.5-omni",)  # asked with audio here (images and video: tests/test_omni.py)


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tiny-models")
    return {f: testing.build_tiny(f, base / f) for f in testing.FAMILIES}


@pytest.fixture(scope="session")
def loaded(built):
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            d = built[family]
            proc = tf.AutoTokenizer.from_pretrained(d) if family in TEXT else tf.AutoProcessor.from_pretrained(d)
            model = MODEL_CLASSES[family].from_pretrained(d).eval()
            cache[family] = (proc, model)
        return cache[family]

    return get


def _image(seed: int = 0, size=(80, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def _sine(seconds: float = 1.5, hz: float = 440.0, sr: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _inputs(family: str, proc, text: str = "Describe this.", image=None, audio=None):
    """One user message (media first, then the text) through the family's own template."""
    if family in TEXT:
        prompt = proc.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return prompt, proc(prompt, return_tensors="pt", add_special_tokens=False)
    if family in VISION:
        image = image if image is not None else _image()
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompt = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return prompt, proc(text=[prompt], images=[image], return_tensors="pt")
    if family in GEMMA:  # the template writes the BOS (as the processor's own apply_chat_template knows)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompt = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return prompt, proc(
            text=[prompt],
            images=[image if image is not None else _image()],
            return_tensors="pt",
            add_special_tokens=False,
        )
    audio = audio if audio is not None else _sine()
    msgs = [{"role": "user", "content": [{"type": "audio", "audio": audio}, {"type": "text", "text": text}]}]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return prompt, proc(text=[prompt], audio=[audio], sampling_rate=16000, return_tensors="pt")


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_loads_renders_and_generates(loaded, family):
    proc, model = loaded(family)
    prompt, inputs = _inputs(family, proc)
    if family == "qwen3":
        assert prompt == "<|im_start|>user\nDescribe this.<|im_end|>\n<|im_start|>assistant\n"
    elif family == "qwen3.5-text":
        assert prompt == "<|im_start|>user\nDescribe this.<|im_end|>\n<|im_start|>assistant\n" + THINK_OFF
    elif family == "llama":
        assert prompt == (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nDescribe this.<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    elif family in VISION:
        system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        system = "" if family in ("qwen3-vl", "qwen3.5") else system
        assert prompt == (
            f"{system}<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this."
            "<|im_end|>\n<|im_start|>assistant\n" + (THINK_OFF if family == "qwen3.5" else "")
        )
        n_img = int(inputs["image_grid_thw"].prod()) // 4
        assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == n_img > 0
    elif family in GEMMA:
        assert prompt == "<bos><start_of_turn>user\n<start_of_image>Describe this.<end_of_turn>\n<start_of_turn>model\n"
        assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == model.config.mm_tokens_per_image
        ids = proc.tokenizer.convert_tokens_to_ids
        assert inputs["input_ids"][0, :2].tolist() == [ids("<bos>"), ids("<start_of_turn>")]  # one BOS
    else:
        audio = "<|audio_bos|><|AUDIO|><|audio_eos|>"
        audio = audio if family in OMNI else f"Audio 1: {audio}\n"
        assert prompt == (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            f"{audio}Describe this.<|im_end|>\n<|im_start|>assistant\n"
        )
        assert inputs["input_features"].shape[1] == 128
        assert int((inputs["input_ids"] == model.config.audio_token_id).sum()) > 0
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new) == 8
    assert len(set(new)) > 1, f"degenerate greedy output {new}"
    tok = proc if family in TEXT else proc.tokenizer
    assert all(i < len(tok) for i in new)


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_config_ids_match_tokenizer(built, family):
    d = built[family]
    tok = tf.AutoTokenizer.from_pretrained(d)
    cfg = tf.AutoConfig.from_pretrained(d)
    gen = tf.GenerationConfig.from_pretrained(d)
    text_cfg = cfg.get_text_config()
    ids = tok.convert_tokens_to_ids
    assert text_cfg.vocab_size >= len(tok)
    assert text_cfg.eos_token_id == tok.eos_token_id
    assert text_cfg.pad_token_id == gen.pad_token_id == tok.pad_token_id
    if family == "llama":
        assert tok.bos_token == "<|begin_of_text|>" and text_cfg.bos_token_id == tok.bos_token_id
        assert gen.eos_token_id == [ids("<|end_of_text|>"), ids("<|eot_id|>")]
    elif family in GEMMA:
        assert tok.bos_token == "<bos>" and text_cfg.bos_token_id == tok.bos_token_id
        assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
        assert gen.eos_token_id == [ids("<eos>"), ids("<end_of_turn>")]
        assert (tok.boi_token, tok.eoi_token, tok.image_token) == (
            "<start_of_image>",
            "<end_of_image>",
            "<image_soft_token>",
        )
        assert (cfg.boi_token_id, cfg.eoi_token_id, cfg.image_token_id) == (
            ids(tok.boi_token),
            ids(tok.eoi_token),
            ids(tok.image_token),
        )
    else:
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
        assert gen.eos_token_id == [ids("<|im_end|>"), ids("<|endoftext|>")]
    if family in VISION:
        assert cfg.image_token_id == ids("<|image_pad|>")
        assert cfg.video_token_id == ids("<|video_pad|>")
        assert cfg.vision_start_token_id == ids("<|vision_start|>")
        assert cfg.vision_end_token_id == ids("<|vision_end|>")
    if family == "qwen2-audio":
        assert cfg.audio_token_index == cfg.audio_token_id == ids("<|AUDIO|>")
    if family in OMNI:  # the processor reads the markers by name
        named = {"image": "<|IMAGE|>", "video": "<|VIDEO|>", "audio": "<|AUDIO|>"}
        for kind, token in named.items():
            assert getattr(tok, f"{kind}_token") == token and getattr(cfg, f"{kind}_token_id") == ids(token)
        assert (cfg.vision_start_token_id, cfg.audio_start_token_id) == (ids("<|vision_bos|>"), ids("<|audio_bos|>"))
    # every special token is one token and survives a round trip
    for t in tok.get_added_vocab():
        assert tok(t, add_special_tokens=False)["input_ids"] == [ids(t)]


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_every_linear_is_wide_enough_for_4bit(loaded, family):
    _, model = loaded(family)
    narrow = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features < 64]
    assert not narrow


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_chat_template_round_trips(built, family):
    d = built[family]
    tok = tf.AutoTokenizer.from_pretrained(d)
    assert tok.chat_template == testing.CHAT_TEMPLATES[family]
    if family not in TEXT:
        proc = tf.AutoProcessor.from_pretrained(d)
        assert proc.chat_template == testing.CHAT_TEMPLATES[family]
        assert (
            type(proc).__name__
            == {
                "qwen2-vl": "Qwen2VLProcessor",
                "qwen2.5-vl": "Qwen2_5_VLProcessor",
                "qwen2-audio": "Qwen2AudioProcessor",
                "gemma3": "Gemma3Processor",
                "qwen3-vl": "Qwen3VLProcessor",
                "qwen2.5-omni": "Qwen2_5OmniProcessor",
                "qwen3.5": "Qwen3VLProcessor",
            }[family]
        )
        if family in GEMMA:
            assert type(proc.image_processor).__name__ == "Gemma3ImageProcessor"
            assert proc.image_seq_length == tf.AutoConfig.from_pretrained(d).mm_tokens_per_image
        elif family in VISION:
            assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessor"
            video = "Qwen3VLVideoProcessor" if family in ("qwen3-vl", "qwen3.5") else "Qwen2VLVideoProcessor"
            assert type(proc.video_processor).__name__ == video
            assert proc.image_processor.size["longest_edge"] == testing.MAX_PIXELS
        else:
            assert type(proc.feature_extractor).__name__ == "WhisperFeatureExtractor"
            assert proc.feature_extractor.feature_size == 128


def test_tokenizer_is_byte_level_and_compact():
    for family in testing.FAMILIES:
        tok = testing.make_tokenizer(family)
        text = "The quick brown fox describes the picture. Ünïcödé ✓ 123"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert len(tok(" the picture", add_special_tokens=False)["input_ids"]) == 2  # merged words
        assert len(ids) < len(text.encode())


def test_thinking_switch_changes_qwen3_rendering(loaded):
    tok, _ = loaded("qwen3")
    msgs = [{"role": "user", "content": "Why?"}]
    on = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    explicit_on = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert on == explicit_on == "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    # <think> is an added token but, as in the published tokenizer, not a special one
    assert "<think>" in tok.get_added_vocab() and "<think>" not in tok.all_special_tokens


def test_build_is_deterministic_and_atomic(tmp_path):
    a = testing.build_tiny("qwen2-vl", tmp_path / "a", seed=0)
    b = testing.build_tiny("qwen2-vl", tmp_path / "b", seed=0)
    c = testing.build_tiny("qwen2-vl", tmp_path / "c", seed=1)
    wa, wb, wc = ((p / "model.safetensors").read_bytes() for p in (a, b, c))
    assert wa == wb and wa != wc
    for name in os.listdir(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # rebuilding over an existing directory replaces it whole and leaves no temp dirs behind
    testing.build_tiny("qwen2-vl", tmp_path / "a", seed=1)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == wc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    assert json.loads((a / tiny.MARKER_FILE).read_text())["seed"] == 1


def test_media_reaches_the_model(loaded):
    for family, kw in (
        ("qwen2-vl", ("image", _image(1), _image(2))),
        ("qwen2-audio", ("audio", _sine(hz=300), _sine(hz=3000))),
    ):
        proc, model = loaded(family)
        key, m1, m2 = kw
        _, i1 = _inputs(family, proc, **{key: m1})
        _, i2 = _inputs(family, proc, **{key: m2})
        with torch.inference_mode():
            l1 = model(**i1).logits[0, -1]
            l2 = model(**i2).logits[0, -1]
        assert not torch.allclose(l1, l2), family


def test_cached_dir_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MM_PIPELINE_HOME", str(tmp_path))
    d = testing.tiny_model_dir(testing.DEFAULT_FAMILY)
    assert d == tmp_path / f"tiny-{testing.DEFAULT_FAMILY}-v{testing.RECIPE_VERSION}"
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert testing.tiny_model_dir(testing.DEFAULT_FAMILY) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp
    assert tf.AutoConfig.from_pretrained(d).model_type == "qwen2_vl"
    with pytest.raises(ValueError):
        testing.tiny_model_dir("gpt2")
    # the embedded default is not built: it is the trained model shipped in the package
    assert tiny.default_model_dir() == Path(tiny.__file__).parent / "shapes_model"
    assert not list(tmp_path.glob("*shapes*"))


def test_4bit_nf4_load_and_generate(built):
    pytest.importorskip("bitsandbytes")
    family = "qwen2-vl"
    q = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = MODEL_CLASSES[family].from_pretrained(built[family], quantization_config=q, device_map="cpu")
    import bitsandbytes as bnb

    quantised = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert any(n.startswith("model.visual") for n in quantised)  # the vision tower is quantised too
    assert any(".layers." in n and "visual" not in n for n in quantised)
    proc = tf.AutoProcessor.from_pretrained(built[family])
    _, inputs = _inputs(family, proc)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    assert out.shape[1] - inputs["input_ids"].shape[1] == 8


def test_a_tiny_family_is_found_from_its_file_alone(tmp_path, monkeypatch):
    """Adding a tiny builder is adding its module: the registry finds it, nothing else to edit."""
    import pipeline.testing as package
    from pipeline.testing import registry

    (tmp_path / "tiny_test_family.py").write_text(
        "from pipeline.testing.llama import *  # noqa\n"
        "from pipeline.testing.llama import CHAT_TEMPLATE, ROLES, SPECIAL_TOKENS, make_config, model_class\n"
        "FAMILY = 'test-llama'\nRANK = 99\n"
    )
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    found = registry._discover()
    assert list(found)[: len(testing.FAMILIES)] == list(testing.FAMILIES)
    assert found["test-llama"].CHAT_TEMPLATE == testing.CHAT_TEMPLATES["llama"]


def test_old_names_still_read_through_pipeline_tiny():
    """``pipeline.tiny`` is the embedded default the runtime imports; the builders live in
    ``pipeline.testing`` (the runtime never imports them: an import-linter contract, checked by
    tests/test_layering.py) and are still read through the names ``pipeline.tiny`` had."""
    import pipeline.testing as t
    from pipeline.tiny import DEFAULT_FAMILY, FAMILIES, RECIPE_VERSION, build_tiny, shapes  # noqa: F401

    assert build_tiny is t.build_tiny and FAMILIES == t.FAMILIES
    assert tiny.CHAT_TEMPLATES is t.CHAT_TEMPLATES
    assert tiny.MARKER_FILE == t.MARKER_FILE and tiny.MAX_PIXELS == t.MAX_PIXELS
    assert shapes.__name__ == "pipeline.tiny.shapes"
    with pytest.raises(AttributeError):
        tiny.no_such_name
