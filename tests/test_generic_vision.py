"""The generic vision family (issue 48): transformers image-text-to-text models no family of the
project knows, built as users build them (``tests/vlm_models.py``: their own config, model and
processor classes, ``save_pretrained``), run through the pipeline with greedy output equal to
``generate()`` on the model's own chat-template rendering."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vlm_models
from pipeline import Pipeline, Request, load_model
from pipeline.errors import UserError
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

ROOT = Path(__file__).resolve().parents[1]
PHOTO, SHAPES = ROOT / "examples" / "photo.jpg", ROOT / "examples" / "shapes.png"
# Two placeholder styles run by default (fixed patch runs; tiles framed by text tokens), the rest slow.
FAST = ["llava", "idefics3"]
ARCHS = [pytest.param(a, marks=() if a in FAST else pytest.mark.slow) for a in vlm_models.BUILDERS]


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = vlm_models.build(model_type, tmp_path_factory.mktemp(model_type))
        return built[model_type]

    return get


def stages() -> dict:
    return {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()}


def reference(lm, image: Image.Image, prompt: str, n: int) -> list[int]:
    """``generate()`` on the processor's own chat-template rendering of one user message."""
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": prompt}]}]
    inputs = lm.processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    ).to(lm.device)
    with torch.inference_mode():
        out = lm.model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_generate(vlm_dir, arch):
    lm = load_model(str(vlm_dir(arch)), dtype=torch.float32, quant="none")
    assert lm.family.name == "vision"
    pipe = Pipeline(lm, stages(), kv_memory=32 << 20)
    image = Image.open(PHOTO).convert("RGB")
    got = pipe.run(Request(prompt="What is in the picture?", images=[image], max_new_tokens=10, ignore_eos=True))
    assert got.token_ids == reference(lm, image, "What is in the picture?", 10)
    assert got.metrics["image_tokens"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_two_images_batched_equal_their_solo_runs_and_the_cache_knows_them_apart(vlm_dir, arch):
    lm = load_model(str(vlm_dir(arch)), dtype=torch.float32, quant="none")
    pipe = Pipeline(lm, stages(), kv_memory=32 << 20)
    asks = [
        Request(prompt="Describe it.", images=[Image.open(p).convert("RGB")], max_new_tokens=8, ignore_eos=True)
        for p in (PHOTO, SHAPES)
    ]
    solo = [pipe.run(r).token_ids for r in asks]
    pipe.pool.clear_prefix_cache()
    handles = [pipe.submit(r) for r in asks]
    assert [h.result().token_ids for h in handles] == solo
    again = pipe.run(asks[1])  # same text, other pixels than the first: only the exact image is reused
    assert again.token_ids == solo[1] and again.metrics["kv_reused_tokens"] > 0


@pytest.mark.parametrize("arch", ["llava_next_video", pytest.param("llava_onevision", marks=pytest.mark.slow)])
def test_a_video_through_get_video_features_equals_generate(vlm_dir, arch, tmp_path):
    """Where the model has ``get_video_features`` the family takes videos: the clip sampled once (the
    pipeline's own sampling), its frames through the processor, greedy output equal to generate()."""
    from test_video import drawn, write_clip

    from pipeline.media import load_video

    lm = load_model(str(vlm_dir(arch)), dtype=torch.float32, quant="none")
    assert lm.family.media == ("image", "video")
    video = load_video(write_clip(tmp_path / "clip.mp4", drawn(16), 8, "h264"))
    got = Pipeline(lm, stages(), kv_memory=32 << 20).run(
        Request(prompt="What happens?", videos=[video], max_new_tokens=10, ignore_eos=True)
    )
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = lm.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = lm.processor(
        text=[text],
        videos=[video.frames],
        video_metadata=[video.metadata()],
        do_sample_frames=False,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = lm.model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert got.token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()
    assert got.metrics["video_frames"] == video.num_frames and got.metrics["video_tokens"] > 0


def chirp(seconds: float = 1.0, rate: int = 24_000) -> np.ndarray:
    """A rising tone: codec codes that change along the clip (a steady tone gives one code throughout)."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * (110 + 400 * t) * t)).astype(np.float32)


def test_audio_through_get_audio_features_equals_generate(vlm_dir):
    """Where the model has ``get_audio_features`` the family takes audio clips (Apertus 1.5: codec codes
    embedded by its text embeddings): each clip through the processor alone, its run filled, greedy output
    equal to generate(); with an image in the same prompt too."""
    from stages import AudioEncoder

    lm = load_model(str(vlm_dir("apertus1p5")), dtype=torch.float32, quant="none")
    assert lm.family.media == ("image", "audio")
    chain = {
        "tokenize": Tokenize(),
        "vision_encoder": VisionEncoder(),
        "audio_encoder": AudioEncoder(),
        "prefill": Prefill(),
        "decode": DecodeLoop(),
    }
    pipe = Pipeline(lm, chain, kv_memory=32 << 20)
    wave, image = chirp(), Image.open(PHOTO).convert("RGB")
    for with_image in (False, True):
        got = pipe.run(
            Request(
                prompt="What do you hear?",
                audios=[(torch.from_numpy(wave), 24_000)],
                images=[image] if with_image else [],
                max_new_tokens=10,
                ignore_eos=True,
            )
        )
        content = [{"type": "image"}] * with_image + [{"type": "audio"}, {"type": "text", "text": "What do you hear?"}]
        text = lm.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        inputs = lm.processor(
            text=[text],
            audio=[wave],
            sampling_rate=24_000,
            images=[image] if with_image else None,
            add_special_tokens=False,
            return_tensors="pt",
        )  # as apply_chat_template: BOS once
        with torch.inference_mode():
            out = lm.model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert got.token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()
        assert got.metrics["audio_tokens"] == 40  # one code per 600 samples


def test_models_without_get_video_features_refuse_a_video_in_one_line(vlm_dir):
    lm = load_model(str(vlm_dir("llava")), dtype=torch.float32, quant="none")
    with pytest.raises(UserError, match="without a video encoder"):
        Pipeline(lm, stages(), kv_memory=32 << 20).run(Request(prompt="?", videos=[str(SHAPES)], max_new_tokens=2))


def test_engine_features_on_a_generic_model(vlm_dir):
    """What the engine does for any family, on a generic one: a prefill in chunks that cut the image's
    run, log-probabilities equal to generate()'s scores, a JSON schema honoured."""
    import json

    lm = load_model(str(vlm_dir("mistral3")), dtype=torch.float32, quant="none")
    image = Image.open(PHOTO).convert("RGB")
    want = reference(lm, image, "What is in the picture?", 6)
    chunked = {**stages(), "prefill": Prefill(chunk_size=5)}
    got = Pipeline(lm, chunked, kv_memory=32 << 20).run(
        Request(prompt="What is in the picture?", images=[image], max_new_tokens=6, ignore_eos=True, logprobs=2)
    )
    assert got.token_ids == want
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is in the picture?"}],
        }
    ]
    inputs = lm.processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = lm.model.generate(
            **inputs,
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
    for step, (token, scores) in enumerate(zip(got.logprobs, out.scores)):
        expected = torch.log_softmax(scores[0].float(), -1)
        assert abs(token.logprob - float(expected[want[step]])) < 1e-4
        assert [t for t, _ in token.top] == expected.topk(2).indices.tolist()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = Pipeline(lm, stages(), kv_memory=32 << 20).run(
        Request(prompt="How many?", images=[image], max_new_tokens=40, json_schema=schema)
    )
    assert isinstance(json.loads(shaped.text)["n"], int)


def test_an_image_the_model_cannot_encode_fails_alone_in_one_line(vlm_dir):
    """Mistral 3 cannot encode a 1x1 image (one patch, merged 2x2): its request ends with one line naming
    the image; a request beside it in the engine gets its solo answer."""
    lm = load_model(str(vlm_dir("mistral3")), dtype=torch.float32, quant="none")
    pipe = Pipeline(lm, stages(), kv_memory=32 << 20)
    good = Request(prompt="Describe it.", images=[Image.open(SHAPES).convert("RGB")], max_new_tokens=6, ignore_eos=True)
    alone = pipe.run(good).token_ids
    pipe.pool.clear_prefix_cache()
    dot = Image.new("RGB", (1, 1), (255, 0, 0))
    handles = [pipe.submit(Request(prompt="Describe it.", images=[dot], max_new_tokens=6)), pipe.submit(good)]
    with pytest.raises(UserError, match=r"^image 1: Mistral3ForConditionalGeneration.get_image_features could not"):
        handles[0].result()
    assert handles[1].result().token_ids == alone


def test_two_images_in_one_prompt(vlm_dir):
    lm = load_model(str(vlm_dir("llava")), dtype=torch.float32, quant="none")
    images = [Image.open(p).convert("RGB") for p in (PHOTO, SHAPES)]
    got = Pipeline(lm, stages(), kv_memory=32 << 20).run(
        Request(prompt="Compare them.", images=images, max_new_tokens=8, ignore_eos=True)
    )
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": images[0]},
                {"type": "image", "image": images[1]},
                {"type": "text", "text": "Compare them."},
            ],
        }
    ]
    inputs = lm.processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = lm.model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert got.token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_a_prompt_attended_both_ways_is_computed_whole_and_reused_only_whole(vlm_dir):
    """PaliGemma attends its whole prompt both ways (its own mask from token_type_ids): a prefill in small
    chunks still computes it whole, and a prompt sharing only its start (the image, ``What is in the``)
    with a cached one reuses none of it: those tokens' keys depend on the words after them."""
    from pipeline.families.model_rules import position_offset

    lm = load_model(str(vlm_dir("paligemma")), dtype=torch.float32, quant="none")
    assert lm.family.name == "vision" and position_offset(lm.model) == 1  # its positions count from 1
    image = Image.open(PHOTO).convert("RGB")
    pipe = Pipeline(lm, {**stages(), "prefill": Prefill(chunk_size=5)}, kv_memory=32 << 20)
    for prompt in ("What is in the picture?", "What is in the box?"):
        got = pipe.run(Request(prompt=prompt, images=[image], max_new_tokens=8, ignore_eos=True))
        assert got.token_ids == reference(lm, image, prompt, 8)
        assert got.metrics["kv_reused_tokens"] == 0
    again = pipe.run(Request(prompt="What is in the box?", images=[image], max_new_tokens=8, ignore_eos=True))
    assert again.token_ids == got.token_ids and again.metrics["kv_reused_tokens"] > 0


def test_blocks_read_off_a_models_own_mask(tmp_path):
    """The rule that reads PaliGemma's prefix gives Gemma 3's image blocks exactly (what its own family
    writes by hand), and a mask that is not causal plus square blocks is refused, not approximated."""
    from pipeline.families.gemma3 import runs
    from pipeline.families.model_rules import attention_blocks, blocks_of
    from pipeline.testing import build_tiny

    lm = load_model(str(build_tiny("gemma3", tmp_path / "gemma3")), dtype=torch.float32, quant="none")
    content = [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]
    text = lm.processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    types = lm.processor(
        text=[text], images=[Image.open(p).convert("RGB") for p in (PHOTO, SHAPES)], return_tensors="pt"
    )["token_type_ids"]
    assert attention_blocks(lm.model, types) == runs((types[0] == 1).tolist()) and len(runs(types[0].tolist())) == 2
    sideways = torch.ones(4, 4, dtype=torch.bool).tril()
    sideways[0, 2] = True  # a token seeing one later token but not the one between
    with pytest.raises(UserError, match="not causal plus blocks"):
        blocks_of(sideways)


def test_the_cli_with_default_settings_equals_generate_on_the_same_weights(vlm_dir):
    """``python -m pipeline model.path=DIR input=IMG prompt=TEXT``, nothing else: a held-out checkpoint
    on CPU loads in int8wo (``quant=auto``); ``generate()`` on those int8wo weights says the same."""
    path = vlm_dir("idefics3")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            f"model.path={path}",
            f"input={PHOTO}",
            "prompt=What is in the picture?",
            "max_new_tokens=10",
            "metrics_table=false",
        ],
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )  # bytes: a "\r" in the answer stays one
    stdout, stderr = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 0, stderr[-2000:]
    assert "quant=auto chose int8wo" in stderr
    from transformers.image_utils import load_image  # as a transformers user loads it: EXIF orientation applied

    lm = load_model(str(path), quant="int8wo")
    want = reference(lm, load_image(str(PHOTO)), "What is in the picture?", 10)
    eos = lm.model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    cut = next((i for i, t in enumerate(want) if t in eos), len(want))
    assert stdout.strip() == lm.tokenizer.decode(want[:cut], skip_special_tokens=True).strip()


@pytest.mark.slow  # a server subprocess (~20 s); the CLI case above runs by default
@pytest.mark.parametrize("arch", ["mistral3", "paligemma"])
def test_served_to_the_openai_client_with_an_image_part_answers_as_the_cli(vlm_dir, tmp_path, arch):
    """``mode=serve`` with default settings: the ``openai`` client's image part (a data URL) gets
    the CLI's answer for the same image and text."""
    import base64

    from openai import OpenAI
    from serving import serving

    path = vlm_dir(arch)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            f"model.path={path}",
            f"input={SHAPES}",
            "prompt=Describe this image.",
            "max_new_tokens=12",
            "metrics_table=false",
        ],
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr.decode()[-2000:]
    png = "data:image/png;base64," + base64.b64encode(SHAPES.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": png}}, {"type": "text", "text": "Describe this image."}]
    with serving(tmp_path, f"model.path={path}") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(
            model=str(path), messages=[{"role": "user", "content": content}], max_tokens=12
        )
    assert got.choices[0].message.content == cli.stdout.decode().strip()
    assert got.usage.completion_tokens >= 1


def test_the_tested_list_is_what_the_tests_build():
    from pipeline.families.vision import TESTED

    assert sorted(TESTED) == sorted(vlm_models.BUILDERS)


@pytest.mark.slow  # imports every mapped model's modeling code (~17 s); the refusal cases below run by default
def test_list_models_says_what_runs_through_which_family():
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", "--list-models"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split("|")[1].strip(" `"): line for line in run.stdout.splitlines() if line.startswith("| `")}
    assert "runs (tested)" in rows["llava"] and "| vision |" in rows["llava"]
    assert "a family of its own" in rows["qwen2_vl"] and "video" in rows["qwen2_vl"]
    assert "refused: its layers cross-attend" in rows["mllama"]
    import transformers

    page = (ROOT / "docs" / "models.md").read_text()
    if f"with transformers {transformers.__version__};" in page:  # another release maps other types: regenerate
        assert page.split("\n\n", 2)[2].strip() == run.stdout.strip()


@pytest.mark.parametrize(
    "model_type, why",
    [
        ("mllama", "cross-attend to the image"),
        ("florence2", "encoder-decoder"),
        ("chameleon", "discrete VQ tokens"),
        ("gemma3n", "per-layer inputs"),
        ("llama4", "chunked_attention"),
        ("qwen3_vl_moe", "deepstack"),
    ],
)
def test_what_cannot_run_is_refused_before_the_weights_load(tmp_path, model_type, why):
    """A config alone (no weights in the folder): refused in one line naming the reason."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(UserError, match=why) as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value) and "is not supported" in str(err.value)
