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

``draw`` paints every image one way (hard pixel edges, exact colours, PNG-clean). Images drawn by
anyone else differ in ways the task leaves open: antialiased edges, JPEG artefacts, slightly
different colour values, a not quite white background, triangles of another height. A model
trained on ``draw`` alone learnt its quirks (94% on an independent reviewer's drawings), so
training draws with ``draw_varied``: the same scenes, each painted in a ``Style`` sampled per
image (``sample_style``). Some settings are deliberately left out of training (``HELD_OUT_*``)
so the tests can draw in a style the model never saw.
"""

from __future__ import annotations

import io
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

# Drawing styles sampled for training (``sample_style``). Each range stays inside what still
# reads unambiguously as the task's image: the colours stay far from one another and from the
# background, and a triangle stays a triangle.
TRAIN_SUPERSAMPLE = (1, 2, 4)  # 1: hard edges as ``render`` draws them; k: drawn k times larger, then downscaled
TRAIN_RESAMPLE = (Image.Resampling.BOX, Image.Resampling.BILINEAR, Image.Resampling.BICUBIC, Image.Resampling.LANCZOS)
TRAIN_JPEG_QUALITIES = (30, 40, 50, 70, 90, 95)
TRAIN_JPEG_SUBSAMPLING = (0, 2)  # 4:4:4 and 4:2:0 chroma
JPEG_SHARE = 2 / 3  # share of varied images that go through a JPEG round trip
MAX_COLOUR_JITTER = 16  # per channel, per shape: still far nearer its own colour than any other
MAX_BACKGROUND_DIM = 12  # per channel: 243..255, still white
MIN_TRIANGLE_HEIGHT = 0.85  # apex height over base width: 1.0 fills the box, an equilateral one is 0.866
# Left out of training on purpose, for tests that draw in a style the model never saw.
HELD_OUT_SUPERSAMPLE = 3
HELD_OUT_RESAMPLE = Image.Resampling.HAMMING
HELD_OUT_JPEG_QUALITIES = (45, 60, 80)
HELD_OUT_JPEG_SUBSAMPLING = 1  # 4:2:2 chroma


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
    return not (
        a.left + a.size < b.left or b.left + b.size < a.left or a.top + a.size < b.top or b.top + b.size < a.top
    )


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
            if all(
                abs(shape.centre_x - s.centre_x) >= MIN_CENTRE_GAP * width and not _overlap(shape, s) for s in shapes
            ):
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


def fill_shape(
    d: ImageDraw.ImageDraw,
    kind: str,
    box: tuple[int, int, int, int],
    fill: tuple[int, int, int],
    triangle_height: float = 1.0,
) -> None:
    """Paint one shape into the inclusive pixel ``box`` (squares axis-aligned; triangles upright,
    base on the box's bottom edge, apex ``triangle_height`` of the base width above it)."""
    x0, y0, x1, y1 = box
    if kind == "circle":
        d.ellipse(box, fill=fill)
    elif kind == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([((x0 + x1) / 2, y1 - (y1 - y0) * triangle_height), (x1, y1), (x0, y1)], fill=fill)


def render(width: int, height: int, shapes: list[Shape]) -> Image.Image:
    """The RGB image of a scene: filled shapes on white (squares axis-aligned, triangles upright)."""
    image = Image.new("RGB", (width, height), BACKGROUND)
    d = ImageDraw.Draw(image)
    for s in shapes:
        fill_shape(d, s.kind, (s.left, s.top, s.left + s.size - 1, s.top + s.size - 1), COLOURS[s.colour])
    return image


@dataclass(frozen=True)
class Style:
    """How a scene becomes pixels. The default is exactly ``render``: hard edges, exact colours,
    pure white, triangles filling their box, no compression."""

    supersample: int = 1  # drawn this many times larger, then downscaled: antialiased edges
    resample: Image.Resampling = Image.Resampling.BOX  # the downscaling filter (unused at 1)
    jpeg_quality: int | None = None  # JPEG round trip at this quality; None: none
    jpeg_subsampling: int = 0  # PIL's chroma subsampling code: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0
    colour_jitter: int = 0  # each shape's fill moves by up to this much per channel
    background_dim: int = 0  # the background loses up to this much per channel
    triangle_height: float = 1.0  # apex height over base width


PLAIN = Style()


def sample_style(rng: np.random.Generator) -> Style:
    """A training style: every factor drawn independently from the ``TRAIN_*`` settings, so the
    model meets each kind of difference alone and in combination."""
    jpeg = rng.random() < JPEG_SHARE
    return Style(
        supersample=TRAIN_SUPERSAMPLE[int(rng.integers(len(TRAIN_SUPERSAMPLE)))],
        resample=TRAIN_RESAMPLE[int(rng.integers(len(TRAIN_RESAMPLE)))],
        jpeg_quality=TRAIN_JPEG_QUALITIES[int(rng.integers(len(TRAIN_JPEG_QUALITIES)))] if jpeg else None,
        jpeg_subsampling=TRAIN_JPEG_SUBSAMPLING[int(rng.integers(len(TRAIN_JPEG_SUBSAMPLING)))],
        colour_jitter=int(rng.integers(0, MAX_COLOUR_JITTER + 1)),
        background_dim=int(rng.integers(0, MAX_BACKGROUND_DIM + 1)),
        triangle_height=float(rng.uniform(MIN_TRIANGLE_HEIGHT, 1.0)),
    )


def jpeg_round_trip(image: Image.Image, quality: int, subsampling: int = 0) -> Image.Image:
    """``image`` as a JPEG file at ``quality`` would decode (blocky edges, ringing, chroma bleed)."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality, subsampling=subsampling)
    buffer.seek(0)
    with Image.open(buffer) as decoded:
        return decoded.convert("RGB")


def _jitter(rng: np.random.Generator, rgb: tuple[int, int, int], amount: int) -> tuple[int, int, int]:
    """``rgb`` moved by up to ``amount`` per channel (clipped to 0..255)."""
    offsets = rng.integers(-amount, amount + 1, size=3)
    return tuple(int(np.clip(c + o, 0, 255)) for c, o in zip(rgb, offsets))  # type: ignore[return-value]


def render_styled(rng: np.random.Generator, width: int, height: int, shapes: list[Shape], style: Style) -> Image.Image:
    """The image of a scene painted in ``style``; ``rng`` draws the style's per-image details
    (colour offsets, background tint, sub-pixel position of each shape when supersampled)."""
    k = style.supersample
    background = tuple(255 - int(v) for v in rng.integers(0, style.background_dim + 1, size=3))
    canvas = Image.new("RGB", (width * k, height * k), background)
    d = ImageDraw.Draw(canvas)
    for s in shapes:
        fill = _jitter(rng, COLOURS[s.colour], style.colour_jitter)
        # a sub-pixel shift keeps edges from always starting on a pixel boundary, never past the image
        dx = min(int(rng.integers(0, k)), (width - s.left - s.size) * k)
        dy = min(int(rng.integers(0, k)), (height - s.top - s.size) * k)
        box = (s.left * k + dx, s.top * k + dy, (s.left + s.size) * k - 1 + dx, (s.top + s.size) * k - 1 + dy)
        fill_shape(d, s.kind, box, fill, style.triangle_height)
    image = canvas if k == 1 else canvas.resize((width, height), style.resample)
    if style.jpeg_quality is not None:
        image = jpeg_round_trip(image, style.jpeg_quality, style.jpeg_subsampling)
    return image


def draw(rng: np.random.Generator) -> tuple[Image.Image, list[Shape]]:
    """One random task image and its shapes, left to right."""
    width, height, shapes = sample_scene(rng)
    return render(width, height, shapes), shapes


def draw_varied(rng: np.random.Generator, plain_fraction: float) -> tuple[Image.Image, list[Shape]]:
    """One training image: a scene as ``draw`` samples it, painted exactly as ``draw`` paints it
    with probability ``plain_fraction`` and in a ``sample_style`` style otherwise."""
    width, height, shapes = sample_scene(rng)
    style = PLAIN if rng.random() < plain_fraction else sample_style(rng)
    return render_styled(rng, width, height, shapes, style), shapes


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
        if (
            len(shapes) == 2
            and shapes[0].kind != shapes[1].kind
            and shapes[0].colour != shapes[1].colour
            and min(s.size for s in shapes) >= 0.3 * min(image.size)
        ):
            return image, shapes
