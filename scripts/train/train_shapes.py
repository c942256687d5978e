"""Train the embedded default: a tiny Qwen2-VL that names the shapes in an image (CPU, minutes).

    python -m scripts.train.train_shapes [--out DIR]

Why: a model with random weights proves the plumbing but not the product. This one is the real
``Qwen2VLForConditionalGeneration`` with the project's tokenizer and the real
``Qwen2VLProcessor``, trained from scratch on the synthetic task of ``pipeline.tiny.shapes``
through the chat template exactly as the pipeline renders a prompt (system prompt added by the
template, one user message: the image, then the question); the loss is on the answer tokens
and the end-of-turn token ``<|im_end|>``. Its answers can be checked by meaning.

The images are the task's scenes painted in a style sampled per image (``shapes.draw_varied``:
antialiased edges, JPEG round trips, shifted colour shades, off-white backgrounds, lower
triangles; a quarter exactly as ``shapes.draw`` paints them). Trained on one way of drawing,
the model answered 97% of its own generator's images but 94% of an independent reviewer's.

Deterministic: the data (``shapes.TRAIN_SEED``), the initialisation and the order of the
batches are seeded, and it runs on 2 threads; a rerun on the same machine and library versions
gives the same weights (about 17 minutes on 2 idle cores; 2600 steps measured 1031 s).

The output is a complete ``from_pretrained`` directory (safetensors, tokenizer, processor, chat
template, generation config) plus the marker file that makes the loader treat it as the
project's own tiny model; by default it replaces ``pipeline/tiny/shapes_model``, which ships in
the package and is what ``default_model_dir()`` returns.
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
from transformers import (
    AutoProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from pipeline.context import Request
from pipeline.families.qwen2_vl import Qwen2VLFamily
from pipeline.testing import qwen2_vl
from pipeline.testing.common import RECIPE_VERSION, _generation_config
from pipeline.testing.tokenizer import make_tokenizer
from pipeline.tiny import shapes
from pipeline.tiny.card import SHAPES_MODEL_DIR
from scripts.train.training import answer_batch, answer_cross_entropy, decoder_sizes, fit, reproducible
from scripts.train.training import save_model, written_whole
from stages.tokenize import build_messages

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedModel, ProcessorMixin

BASE_FAMILY = "qwen2-vl"
SHIPPED_DIR = SHAPES_MODEL_DIR  # pipeline/tiny/shapes_model: what default_model_dir() returns
EXAMPLE_IMAGE = "example.png"  # written next to the weights: what `python -m pipeline` asks about with no input
THREADS = 2


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights: sizes, positions, pixels, optimiser, schedule, data mix, seeds."""

    hidden: int = 128
    intermediate: int = 256
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    vision_dim: int = 64
    vision_depth: int = 2
    vision_heads: int = 4
    init_range: float = 0.08
    rope_theta: float = 200.0
    # Every image is resized to about 112x112 (min = max pixel budget) and cut into 7-pixel patches:
    # the smallest shape (20% of 112 px) then spans 3 patches. At 14-pixel patches shapes were a
    # patch or two wide and the model could not learn their kinds (45% on the shapes question).
    pixels: int = 112 * 112
    patch_size: int = 7
    steps: int = 2600
    batch: int = 32
    lr: float = 2e-3
    min_lr_fraction: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    count_fraction: float = 0.25  # share of samples asking the count question
    # share of images painted exactly as shapes.draw paints them; the rest in a sampled style
    # (antialiased, JPEG, jittered colours...), so the model is not tied to one way of drawing
    plain_fraction: float = 0.25
    data_seed: int = shapes.TRAIN_SEED
    init_seed: int = 0


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


def mrope_section(head_dim: int) -> list[int]:
    """M-RoPE split of the rotary half-dimension over (temporal, height, width), in the published
    proportions (16, 24, 24 of 64)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def make_config(tok: Any, recipe: Recipe) -> Any:
    """A real Qwen2-VL config at the recipe's sizes (token ids shared with the random tiny builder).

    ``rope_theta`` is far below the published 1e6: M-RoPE gives the width positions the lowest
    rotary frequencies, and at 1e6 with a 32-wide head they barely turn across an image, so the
    model could not tell left from right."""
    head_dim = recipe.hidden // recipe.heads
    text = qwen2_vl._text_config(tok, BASE_FAMILY)
    text.update(
        **decoder_sizes(recipe),
        rope_parameters={
            **text["rope_parameters"],
            "rope_theta": recipe.rope_theta,
            "mrope_section": mrope_section(head_dim),
        },
    )
    return Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=recipe.vision_depth,
            embed_dim=recipe.vision_dim,
            hidden_size=recipe.hidden,
            mlp_ratio=2,
            num_heads=recipe.vision_heads,
            in_channels=3,
            patch_size=recipe.patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            initializer_range=recipe.init_range,
        ),
        **qwen2_vl._vision_token_ids(tok),
        tie_word_embeddings=False,
    )


def make_processor(tok: Any, recipe: Recipe) -> ProcessorMixin:
    """The real ``Qwen2VLProcessor`` of the tiny builder, with the recipe's pixel budget."""
    kw = dict(
        min_pixels=recipe.pixels,
        max_pixels=recipe.pixels,
        patch_size=recipe.patch_size,
        temporal_patch_size=2,
        merge_size=2,
    )
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**kw),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**kw),
        chat_template=qwen2_vl.CHAT_TEMPLATE,
    )


def build(recipe: Recipe, workdir: Path) -> tuple[PreTrainedModel, ProcessorMixin]:
    """A freshly initialised model (seeded) and the processor as the pipeline loads it:
    saved with ``save_pretrained`` and read back with ``AutoProcessor``."""
    tok = make_tokenizer(BASE_FAMILY)
    make_processor(tok, recipe).save_pretrained(workdir)
    processor = AutoProcessor.from_pretrained(workdir)
    torch.manual_seed(recipe.init_seed)
    model = Qwen2VLForConditionalGeneration(make_config(tok, recipe))
    model.generation_config = _generation_config(qwen2_vl.ROLES, tok)
    return model, processor


# --------------------------------------------------------------------------------------
# The data, rendered and tokenized as the pipeline does
# --------------------------------------------------------------------------------------


@contextmanager
def one_thread() -> Iterator[None]:
    """Image preprocessing is many tiny tensor ops: on a busy machine two OpenMP threads spend
    far more time synchronising than computing, so it runs on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def prompt_text(processor: ProcessorMixin, question: str) -> str:
    """The prompt exactly as the pipeline's Tokenize stage renders it for one image and a question."""
    messages = build_messages(Request(prompt=question, images=["image"]), Qwen2VLFamily())
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class Encoder:
    """Turns (image, question, answer) triples into a training batch, tokenized exactly as the
    processor does for the pipeline, but fast: one image-processor call per batch, and the prompt
    ids spliced around the placeholder run instead of re-tokenizing every prompt (the processor's
    per-example text path costs more than the training step's vision tower; tests/test_shapes.py
    checks both give the same ids)."""

    def __init__(self, processor: ProcessorMixin) -> None:
        self.processor = processor
        tok = processor.tokenizer
        self.image_token = tok.convert_tokens_to_ids(processor.image_token)
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.pad = tok.pad_token_id
        self.merge = processor.image_processor.merge_size
        self.around: dict[str, tuple[list[int], list[int]]] = {}
        for question in shapes.QUESTIONS:
            ids = tok(prompt_text(processor, question), add_special_tokens=False)["input_ids"]
            cut = ids.index(self.image_token)  # the template holds one placeholder; the processor expands it
            self.around[question] = (ids[:cut], ids[cut + 1 :])
        self.answers: dict[str, list[int]] = {}

    def _answer_ids(self, answer: str) -> list[int]:
        if answer not in self.answers:
            self.answers[answer] = self.processor.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.end]
        return self.answers[answer]

    def __call__(self, images: list[Image.Image], questions: list[str], answers: list[str]) -> dict[str, Any]:
        """Right-padded batch with labels on the answer and ``<|im_end|>`` only; the patches of all
        images concatenated, as Qwen2-VL takes them."""
        with one_thread():
            pixels = self.processor.image_processor(images=images, return_tensors="pt")
        grids = pixels["image_grid_thw"]
        rows = []
        for question, answer, grid in zip(questions, answers, grids.tolist(), strict=True):
            before, after = self.around[question]
            n_image = grid[0] * grid[1] * grid[2] // self.merge**2
            prompt = before + [self.image_token] * n_image + after
            rows.append((prompt, self._answer_ids(answer), len(before), n_image))
        batch = answer_batch([(prompt, answer) for prompt, answer, _, _ in rows], self.pad)
        types = torch.zeros_like(batch["input_ids"])  # which positions are image placeholders (M-RoPE needs it)
        for i, (_, _, first, n_image) in enumerate(rows):
            types[i, first : first + n_image] = 1
        return {
            **batch,
            "mm_token_type_ids": types,
            "pixel_values": pixels["pixel_values"],
            "image_grid_thw": grids,
        }


def sample_batch(rng: np.random.Generator, encoder: Encoder, recipe: Recipe, size: int) -> dict[str, Any]:
    """``size`` fresh training examples: an image from the task (in a varied drawing style) and
    one of its two questions."""
    images, questions, answers = [], [], []
    for _ in range(size):
        image, drawn = shapes.draw_varied(rng, recipe.plain_fraction)
        question = shapes.COUNT_QUESTION if rng.random() < recipe.count_fraction else shapes.SHAPES_QUESTION
        images.append(image)
        questions.append(question)
        answers.append(shapes.answer(question, drawn))
    return encoder(images, questions, answers)


# --------------------------------------------------------------------------------------
# Training and evaluation
# --------------------------------------------------------------------------------------


def answer_loss(model: PreTrainedModel, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy over the answer tokens, and per sequence whether every answer token is the
    argmax (teacher-forced, which is exactly "greedy decoding gives this answer")."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss, hit, mask = answer_cross_entropy(model(**inputs).logits, batch["labels"])
    return loss, (hit | ~mask).all(dim=1)


def evaluate(
    model: PreTrainedModel, encoder: Encoder, data: list[tuple[Image.Image, list[shapes.Shape]]], batch: int = 50
) -> dict[str, float]:
    """Greedy exact-match rate per question on ``data`` (teacher-forced argmax)."""
    scores: dict[str, float] = {}
    model.eval()
    for name, question in (("shapes", shapes.SHAPES_QUESTION), ("count", shapes.COUNT_QUESTION)):
        right = 0
        for start in range(0, len(data), batch):
            part = data[start : start + batch]
            inputs = encoder(
                [image for image, _ in part],
                [question] * len(part),
                [shapes.answer(question, drawn) for _, drawn in part],
            )
            with torch.no_grad():
                _, hit = answer_loss(model, inputs)
            right += int(hit.sum())
        scores[name] = right / len(data)
    return scores


def heldout_sets(n: int = 200) -> dict[str, list[tuple[Image.Image, list[shapes.Shape]]]]:
    """The images the trainer scores itself on, from ``shapes.EVAL_SEED`` (training never draws
    from it): drawn as ``shapes.draw`` draws (what tests/test_shapes.py checks too), and in the
    varied training styles (robustness the plain set cannot show)."""
    rng = np.random.default_rng(shapes.EVAL_SEED + 1)
    return {
        "heldout_exact": shapes.dataset(shapes.EVAL_SEED, n),
        "heldout_varied_exact": [shapes.draw_varied(rng, plain_fraction=0.0) for _ in range(n)],
    }


def train(recipe: Recipe, out: Path, progress: bool = True) -> dict[str, Any]:
    """Train with ``recipe`` and write the model directory to ``out`` (atomically). Returns a
    summary: steps, seconds, final loss and held-out accuracies."""
    with reproducible(THREADS), written_whole(out) as work:
        model, processor = build(recipe, work)
        encoder = Encoder(processor)
        rng = np.random.default_rng(recipe.data_seed)

        def loss_of(batch: dict[str, Any]) -> tuple[torch.Tensor, float]:
            loss, hit = answer_loss(model, batch)
            return loss, hit.float().mean().item()

        fitted = fit(
            model,
            recipe,
            lambda step: sample_batch(rng, encoder, recipe, recipe.batch),
            loss_of,
            "train shapes",
            metric="exact",
            progress=progress,
        )
        scores = {name: evaluate(model, encoder, data) for name, data in heldout_sets().items()}
        summary = {"steps": recipe.steps, **fitted, **scores, "recipe": asdict(recipe)}
        save(model, processor, work, summary)
    return summary


def save(model: PreTrainedModel, processor: ProcessorMixin, dest: Path, summary: dict[str, Any]) -> None:
    """Weights, processor (tokenizer and chat template inside), the example image and the marker."""
    image, _ = shapes.example()
    image.save(dest / EXAMPLE_IMAGE, optimize=True)
    save_model(
        model,
        dest,
        {
            "family": BASE_FAMILY,
            "recipe_version": RECIPE_VERSION,
            "trained": "shapes",
            "note": "a toy model trained by mm-pipeline (python -m scripts.train.train_shapes) to name the "
            "shapes in images; other prompts get meaningless text",
            "default_prompts": {"image": shapes.SHAPES_QUESTION},
            "example_image": EXAMPLE_IMAGE,
            **summary,
        },
        processor,
    )
    for path in dest.iterdir():
        os.chmod(path, 0o644)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR, help=f"output directory (default: {SHIPPED_DIR})")
    args = parser.parse_args(argv)
    summary = train(Recipe(), args.out)
    plain, varied = summary["heldout_exact"], summary["heldout_varied_exact"]
    print(
        f"{args.out}: {summary['steps']} steps in {summary['train_seconds']:.0f} s, loss {summary['final_loss']:.4f}, "
        f"held-out greedy exact match: shapes {plain['shapes']:.1%}, count {plain['count']:.1%} "
        f"(varied styles: shapes {varied['shapes']:.1%}, count {varied['count']:.1%})"
    )


if __name__ == "__main__":
    main()
