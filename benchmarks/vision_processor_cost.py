"""What the generic vision family's second processor run per image costs (issue 48).

The family runs the model's processor on the whole prompt (for the ids) and on each image alone
(for that image's own inputs, slot count and hash): the image is resized and normalised twice.
This times both calls with each processor's published image settings (image processors have no
weights, so their defaults are the released behaviour; the tokenizer is the project's tiny one),
on one 1024x768 photo, median of ``--reps``.

    python benchmarks/vision_processor_cost.py --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def tokenizer(tokens: list[str]) -> Any:
    from pipeline.testing.tokenizer import make_tokenizer

    tok = make_tokenizer("llama")
    tok.add_special_tokens({"additional_special_tokens": tokens})
    return tok


def processors() -> dict[str, tuple[Any, str]]:
    """name -> (processor with the published image settings, its image placeholder)."""
    from transformers import (
        CLIPImageProcessor,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaProcessor,
        PixtralImageProcessor,
        PixtralProcessor,
    )

    llava = dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    tiles = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    return {
        "LLaVA 1.5 (CLIP 336)": (
            LlavaProcessor(
                CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
                tokenizer(["<image>"]),
                **llava,
            ),
            "<image>",
        ),
        "LLaVA-NeXT (anyres 336)": (
            LlavaNextProcessor(LlavaNextImageProcessor(), tokenizer(["<image>"]), **llava),
            "<image>",
        ),
        "SmolVLM / Idefics3 (364 tiles)": (
            Idefics3Processor(
                Idefics3ImageProcessor(),
                tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *tiles]),
                image_seq_len=169,
            ),
            "<image>",
        ),
        "Mistral 3 (Pixtral, 1540)": (
            PixtralProcessor(
                PixtralImageProcessor(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14}),
                tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"]),
                patch_size=14,
                spatial_merge_size=2,
            ),
            "[IMG]",
        ),
    }


def median_s(call: Callable[[], Any], reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    image = Image.open(ROOT / "examples" / "photo.jpg").convert("RGB").resize((1024, 768))
    print("| processor | whole prompt (ms) | the image alone (ms) | added |\n|---|---|---|---|")
    for name, (proc, marker) in processors().items():
        prompt = f"USER: {marker}\nWhat is in the picture? ASSISTANT:"
        whole = median_s(lambda: proc(text=[prompt], images=[image], return_tensors="pt"), args.reps)
        alone = median_s(
            lambda: proc(text=[marker], images=[image], add_special_tokens=False, return_tensors="pt"), args.reps
        )
        print(f"| {name} | {whole * 1e3:.1f} | {alone * 1e3:.1f} | {alone / whole:.0%} |")


if __name__ == "__main__":
    main()
