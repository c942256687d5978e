"""The synthetic task the embedded default model is trained on: name the shapes in an image.

Why a fixed, public task: anyone can draw fresh test images with this module and check the
shipped model's answers by meaning (``answer`` is the ground truth), which exercises the
whole vision path (processor, encoder, placeholder merge, 3-D positions, decode).

The task, exactly:

- White background, 112..224 pixels on each side (any aspect ratio).
- One or two non-overlapping filled shapes from circle / square / triangle in red, green,
  blue or yellow (the RGB values in ``COLOURS``), each 20-50% of the shorter side, at random
  positions, their horizontal centres at least 25% of the width apart.
- ``SHAPES_QUESTION`` -> the shapes left to right: ``a red circle`` or
  ``a red circle and a blue square``.  ``COUNT_QUESTION`` -> ``one`` or ``two``.

Everything is drawn from a ``numpy.random.Generator``, so a seed gives the same images on any
machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES_QUESTION = "What shapes are in the image?"
COUNT_QUESTION = "How many shapes are there?"
QUESTIONS = (SHAPES_QUESTION, COUNT_QUESTION)

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 20),
}
KINDS = ("circle", "square", "triangle")
MIN_SIDE, MAX_SIDE = 112, 224
MIN_FRACTION, MAX_FRACTION = 0.20, 0.50  # shape size as a fraction of the image's shorter side
MIN_CENTRE_GAP = 0.25  # horizontal centres at least this fraction of the width apart
BACKGROUND = (255, 255, 255)
COUNT_WORDS = {1: "one", 2: "two"}

# Seeds: training draws from TRAIN_SEED; the held-out checks (tests, the training script's final
# evaluation) from EVAL_SEED, which training never uses.
TRAIN_SEED = 0
EVAL_SEED = 20240601
EXAMPLE_SEED = 7  # examples/shapes.png and the image `python -m pipeline` asks about with no input


@dataclass(frozen=True)
class Shape:
    """One filled shape: its kind and colour names, and its bounding box (left, top, size) in pixels."""

    kind: str
    colour: str
    left: int
    top: int
    size: int

    @property
    def centre_x(self) -> float:
        return self.left + self.size / 2

    def describe(self) -> str:
        return f"a {self.colour} {self.kind}"


def _overlap(a: Shape, b: Shape) -> bool:
    """Bounding boxes touch or overlap (a one-pixel gap is required, so shapes never merge)."""
    return not (a.left + a.size < b.left or b.left + b.size < a.left or a.top + a.size < b.top or b.top + b.size < a.top)


def _place(rng: np.random.Generator, width: int, height: int, n: int) -> list[Shape] | None:
    """Try once to place ``n`` shapes that respect the task's rules; None when this try fails."""
    short = min(width, height)
    shapes: list[Shape] = []
    for _ in range(n):
        size = int(rng.integers(int(np.ceil(MIN_FRACTION * short)), int(MAX_FRACTION * short) + 1))
        kind = KINDS[int(rng.integers(len(KINDS)))]
        colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        for _ in range(50):
            left = int(rng.integers(0, width - size + 1))
            top = int(rng.integers(0, height - size + 1))
            shape = Shape(kind, colour, left, top, size)
            if all(abs(shape.centre_x - s.centre_x) >= MIN_CENTRE_GAP * width and not _overlap(shape, s)
                   for s in shapes):
                shapes.append(shape)
                break
        else:
            return None
    return shapes


def sample_scene(rng: np.random.Generator) -> tuple[int, int, list[Shape]]:
    """Image size and the shapes (left to right) of one random scene."""
    while True:
        width = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
        height = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
        n = int(rng.integers(1, 3))
        shapes = _place(rng, width, height, n)
        if shapes is not None:
            return width, height, sorted(shapes, key=lambda s: s.centre_x)


def render(width: int, height: int, shapes: list[Shape]) -> Image.Image:
    """The RGB image of a scene: filled shapes on white (squares axis-aligned, triangles upright)."""
    image = Image.new("RGB", (width, height), BACKGROUND)
    d = ImageDraw.Draw(image)
    for s in shapes:
        fill = COLOURS[s.colour]
        box = [s.left, s.top, s.left + s.size - 1, s.top + s.size - 1]
        if s.kind == "circle":
            d.ellipse(box, fill=fill)
        elif s.kind == "square":
            d.rectangle(box, fill=fill)
        else:
            x0, y0, x1, y1 = box
            d.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def draw(rng: np.random.Generator) -> tuple[Image.Image, list[Shape]]:
    """One random task image and its shapes, left to right."""
    width, height, shapes = sample_scene(rng)
    return render(width, height, shapes), shapes


def answer(question: str, shapes: list[Shape]) -> str:
    """The exact expected answer (without the end-of-turn token) to one of ``QUESTIONS``."""
    ordered = sorted(shapes, key=lambda s: s.centre_x)
    if question == SHAPES_QUESTION:
        return " and ".join(s.describe() for s in ordered)
    if question == COUNT_QUESTION:
        return COUNT_WORDS[len(ordered)]
    raise ValueError(f"not a question of the shapes task: {question!r} (ask one of {QUESTIONS})")


def dataset(seed: int, n: int) -> list[tuple[Image.Image, list[Shape]]]:
    """``n`` images drawn from ``seed``: the same list on every machine (for held-out checks)."""
    rng = np.random.default_rng(seed)
    return [draw(rng) for _ in range(n)]


def example() -> tuple[Image.Image, list[Shape]]:
    """The example image (``examples/shapes.png``, and the no-input run's image): two different,
    clearly visible shapes."""
    rng = np.random.default_rng(EXAMPLE_SEED)
    while True:
        image, shapes = draw(rng)
        if (len(shapes) == 2 and shapes[0].kind != shapes[1].kind and shapes[0].colour != shapes[1].colour
                and min(s.size for s in shapes) >= 0.3 * min(image.size)):
            return image, shapes
