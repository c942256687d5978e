"""Image loading: any common still-image file -> an upright RGB ``PIL.Image``.

Every problem with the file itself (missing, empty, not an image, truncated, too large)
becomes one ``UserError`` whose one-line message starts with the file's path.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from pipeline.errors import UserError

DEFAULT_MAX_PIXELS = 64_000_000

_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_GREY_WIDE_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I", "F"}
# ImageFile.LOAD_TRUNCATED_IMAGES is process-wide state; we switch it off around our own
# decodes (some libraries switch it on), under a lock so concurrent loads do not race.
_TRUNCATED_FLAG_LOCK = threading.Lock()


def has_image_signature(head: bytes) -> bool:
    """True if ``head`` (a file's first 12+ bytes) starts like JPEG/PNG/GIF/BMP/TIFF/WebP."""
    return (
        head.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a"))
        or (head[:2] == b"BM" and head[6:10] == b"\0\0\0\0")  # BMP: reserved bytes are zero
        or head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # TIFF / BigTIFF
        or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
    )


def one_line(exc: BaseException | str) -> str:
    """An exception's message squeezed onto one line (decoders like multi-line messages)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, BaseException) and not text:
        text = type(exc).__name__
    return text


def check_file(path: str | os.PathLike) -> Path:
    """The path as a ``Path`` if it is an existing, non-empty regular file; else ``UserError``."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: file not found")
    if p.is_dir():
        raise UserError(f"{path}: is a directory, not a media file")
    if not p.is_file():
        raise UserError(f"{path}: not a regular file")
    try:
        size = p.stat().st_size
    except OSError as e:
        raise UserError(f"{path}: cannot read file ({one_line(e)})") from None
    if size == 0:
        raise UserError(f"{path}: empty file (0 bytes)")
    return p


def load_image(path: str | os.PathLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode ``path`` fully and return it upright (EXIF orientation applied) in RGB.

    Transparent pixels are composited on white. Multi-frame files (GIF, WebP, TIFF) give
    their first frame. Images with more than ``max_pixels`` pixels are refused from the
    header, before any pixel data is decoded.
    """
    p = check_file(path)
    try:
        with warnings.catch_warnings():
            # Pillow's own decompression-bomb guard warns past Image.MAX_IMAGE_PIXELS and raises
            # past twice that. Its warning becomes an error unless the caller deliberately
            # allowed more pixels than Pillow does (then our header check below decides).
            limit = Image.MAX_IMAGE_PIXELS
            action = "ignore" if limit is not None and max_pixels > limit else "error"
            warnings.simplefilter(action, Image.DecompressionBombWarning)
            with Image.open(p) as im:
                w, h = im.size
                if w * h > max_pixels:
                    raise UserError(
                        f"{path}: image is {w}x{h} = {w * h:,} pixels, over the limit of {max_pixels:,} (max_pixels)"
                    )
                if w <= 0 or h <= 0:
                    raise UserError(f"{path}: image has no pixels ({w}x{h})")
                with _TRUNCATED_FLAG_LOCK:
                    saved = ImageFile.LOAD_TRUNCATED_IMAGES
                    ImageFile.LOAD_TRUNCATED_IMAGES = False
                    try:
                        im.load()  # full decode: a truncated/corrupt stream raises here
                    finally:
                        ImageFile.LOAD_TRUNCATED_IMAGES = saved
                try:
                    upright = ImageOps.exif_transpose(im)  # a new image, detached from the file
                except Exception:  # unreadable EXIF must not reject good pixels
                    upright = im.copy()
                return to_rgb(upright)
    except UserError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise UserError(f"{path}: image too large, refused as a possible decompression bomb ({one_line(e)})") from None
    except UnidentifiedImageError:
        if has_image_signature(_head(p)):
            raise UserError(f"{path}: corrupt image header (Pillow cannot identify it)") from None
        raise UserError(f"{path}: not an image file (or an image format Pillow cannot read)") from None
    except MemoryError:
        raise UserError(f"{path}: not enough memory to decode this image") from None
    except Exception as e:  # decoders raise OSError, SyntaxError, ValueError, EOFError, zlib.error...
        raise UserError(f"{path}: corrupt or truncated image ({one_line(e)})") from None


def _head(p: Path, n: int = 16) -> bytes:
    try:
        with open(p, "rb") as fh:
            return fh.read(n)
    except OSError:
        return b""


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB: alpha/transparency composited on white, wide grey scaled."""
    if im.mode == "RGB" and "transparency" not in im.info:
        return im.copy() if im.readonly else im
    if im.mode in _GREY_WIDE_MODES:
        return Image.fromarray(_grey_to_u8(im), "L").convert("RGB")
    if im.mode in _ALPHA_MODES or "transparency" in im.info:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    # L, 1, P (opaque), CMYK, YCbCr, LAB, HSV, ...
    return im.convert("RGB")


def _grey_to_u8(im: Image.Image) -> np.ndarray:
    """Scale a wide grey image to 0..255.

    ``I;16*``: the full 16-bit range. ``I`` (32-bit int) and ``F`` (float) carry no range, so
    it is read from the values: F within [0, 1] is scaled by 255; values within [0, 255] are
    kept; I within [0, 65535] is treated as 16-bit; anything else is min-max stretched.
    """
    a = np.asarray(im)
    if im.mode.startswith("I;16"):
        scaled = a.astype(np.float64) * (255.0 / 65535.0)
    else:
        a = a.astype(np.float64)
        finite = a[np.isfinite(a)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
        if im.mode == "F" and lo >= 0.0 and hi <= 1.0:
            scaled = a * 255.0
        elif lo >= 0.0 and hi <= 255.0:
            scaled = a
        elif im.mode != "F" and lo >= 0.0 and hi <= 65535.0:
            scaled = a * (255.0 / 65535.0)
        else:
            scaled = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
        scaled = np.nan_to_num(scaled, nan=0.0, posinf=255.0, neginf=0.0)
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)
