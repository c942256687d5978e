"""Write the small example inputs next to this script (deterministic, offline).

    python examples/make_examples.py [OUT_DIR]

shapes.png   an image of the embedded default's task (pipeline.tiny.shapes.example()): two
             filled shapes on white; `python -m pipeline input=examples/shapes.png` names them
photo.jpg    a 320x240 synthetic scene (sky, ground, sun, house, tree) as a JPEG stored sideways
             with EXIF Orientation=6, so a loader that honours EXIF gets it upright (320x240) and
             one that does not gets 240x320
tone.wav     2 s, 16 kHz, mono 16-bit: spoken words if espeak-ng is installed, else a
             little melody of sine tones (C-E-G-C)
prompts.txt  five short prompts, one per line (with a comment and a blank line)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
from PIL import Image, ImageDraw

from pipeline.tiny import shapes

WIDTH, HEIGHT = 320, 240
RATE = 16_000
SECONDS = 2.0

PROMPTS = """\
# One prompt per line; lines starting with '#' and blank lines are ignored.
Describe this image in one sentence.
What colour is the sun?

How many windows does the house have?
Transcribe the audio.
Write a haiku about a quiet afternoon.
"""


def draw_scene() -> Image.Image:
    im = Image.new("RGB", (WIDTH, HEIGHT))
    d = ImageDraw.Draw(im)
    horizon = 160
    for y in range(horizon):  # sky: a vertical gradient
        t = y / horizon
        d.line([(0, y), (WIDTH, y)], fill=(int(90 + 80 * t), int(150 + 70 * t), 235))
    d.rectangle([0, horizon, WIDTH, HEIGHT], fill=(70, 150, 60))  # ground
    d.ellipse([245, 20, 295, 70], fill=(255, 210, 40))  # sun
    d.rectangle([60, 110, 160, 185], fill=(200, 60, 50))  # house
    d.polygon([(50, 110), (110, 65), (170, 110)], fill=(120, 70, 40))  # roof
    d.rectangle([100, 150, 122, 185], fill=(90, 50, 30))  # door
    d.rectangle([72, 125, 92, 142], fill=(200, 230, 255))  # windows
    d.rectangle([130, 125, 150, 142], fill=(200, 230, 255))
    d.rectangle([222, 130, 232, 185], fill=(100, 65, 35))  # tree trunk
    d.ellipse([200, 90, 255, 145], fill=(30, 110, 40))  # tree crown
    return im


def save_photo(scene: Image.Image, path: Path) -> None:
    # Orientation 6 = "rotate 90 degrees clockwise to display": store the scene turned
    # 90 degrees counter-clockwise, as a camera held sideways would.
    stored = scene.transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    stored.save(path, "JPEG", quality=85, exif=exif.tobytes())


def melody() -> np.ndarray:
    n = int(RATE * SECONDS)
    t = np.arange(n) / RATE
    notes = [261.63, 329.63, 392.00, 523.25]  # C4 E4 G4 C5, half a second each
    wave = np.zeros(n)
    seg = n // len(notes)
    for i, f in enumerate(notes):
        s = slice(i * seg, (i + 1) * seg)
        env = np.minimum(1.0, np.minimum(np.arange(seg), np.arange(seg)[::-1]) / (0.02 * RATE))
        wave[s] = 0.4 * env * np.sin(2 * np.pi * f * t[s])
    return wave


def speech() -> np.ndarray | None:
    exe = shutil.which("espeak-ng")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        try:
            subprocess.run(
                [exe, "-s", "150", "-w", str(out), "Hello, this is a test."],
                check=True,
                capture_output=True,
                timeout=30,
            )
            data, rate = sf.read(out, dtype="float64", always_2d=True)
        except (OSError, subprocess.SubprocessError, RuntimeError):
            return None
    data = data.mean(axis=1)
    if rate != RATE:  # linear interpolation is enough for an example input
        x = np.arange(int(len(data) * RATE / rate)) * rate / RATE
        data = np.interp(x, np.arange(len(data)), data)
    n = int(RATE * SECONDS)
    return np.pad(data[:n], (0, max(0, n - len(data))))


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    image, _ = shapes.example()
    image.save(out_dir / "shapes.png", optimize=True)
    save_photo(draw_scene(), out_dir / "photo.jpg")
    wave = speech()
    if wave is None:
        wave = melody()
    sf.write(out_dir / "tone.wav", wave.astype(np.float32), RATE, subtype="PCM_16")
    (out_dir / "prompts.txt").write_text(PROMPTS)
    for name in ("shapes.png", "photo.jpg", "tone.wav", "prompts.txt"):
        print(f"{out_dir / name}  {(out_dir / name).stat().st_size:,} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
