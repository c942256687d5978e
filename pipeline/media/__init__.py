"""Media inputs: decide a file's kind from its content, load images, audio and video, hash them.

    media_kind(path) -> "image" | "audio" | "video"
    load_inputs(paths, ...) -> Inputs(images, audios, videos, kinds)   # kinds: the paths' order
    load_media(paths, target_rate=16000) -> (images, audios)   # audios: [(wave, rate)]; no video
    load_image(path, max_pixels=64_000_000) -> RGB PIL.Image
    load_audio(path, target_rate) -> (1-D float32 mono wave, duration_s)
    load_video(path, fps=2.0, max_frames=64) -> Video (sampled RGB frames + timing)
    split_audio(wave, rate, window_s) -> [chunks]
    content_hash(image | (wave, rate) | Video) -> sha256 hex   # KV-cache media identity

All problems with an input file raise ``pipeline.errors.UserError`` with a one-line message
that starts with the file's path.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Iterable, Literal

import numpy as np
import soundfile as sf
import torch
from PIL import Image

from pipeline.errors import UserError
from pipeline.media.audio import load_audio, split_audio
from pipeline.media.images import DEFAULT_MAX_PIXELS, check_file, has_image_signature, load_image, to_rgb
from pipeline.media.video import DEFAULT_VIDEO_FPS, DEFAULT_VIDEO_MAX_FRAMES, Video, load_video

__all__ = [
    "media_kind",
    "load_inputs",
    "load_media",
    "load_image",
    "load_audio",
    "load_video",
    "split_audio",
    "content_hash",
    "to_rgb",
    "Inputs",
    "Video",
    "DEFAULT_MAX_PIXELS",
    "DEFAULT_VIDEO_FPS",
    "DEFAULT_VIDEO_MAX_FRAMES",
]

MediaKind = Literal["image", "audio", "video"]


def _video_signature(head: bytes) -> bool:
    """MP4 / MOV / 3GP (ISO base media: an ``ftyp``, ``moov``, ``mdat``... box first), WebM /
    Matroska (EBML), AVI, FLV, MPEG program stream. M4A-style audio-only brands are not video."""
    return (
        (
            head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")
            and head[8:12] not in (b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B ")
        )
        or head[:4] == b"\x1a\x45\xdf\xa3"
        or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")
        or head[:3] == b"FLV"
        or head[:4] == b"\x00\x00\x01\xba"
    )


def _gif_frames(p) -> int:
    """Frames in a GIF (1 when Pillow cannot tell: then it is read as a still image)."""
    try:
        with Image.open(p) as im:
            return int(getattr(im, "n_frames", 1))
    except Exception:
        return 1


def _sniff(head: bytes) -> MediaKind | None:
    """Kind from well-known signatures, or None when the bytes are not conclusive."""
    if _video_signature(head):
        return "video"
    if has_image_signature(head):
        return "image"
    if head[:4] in (b"RIFF", b"RIFX", b"RF64") and head[8:12] == b"WAVE":
        return "audio"
    if head[:4] in (b"fLaC", b"OggS", b".snd", b"caff") or head[:3] == b"ID3":
        return "audio"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "audio"
    if len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xE0) == 0xE0:  # MPEG audio frame sync
        return "audio"
    return None


def media_kind(path: str | os.PathLike) -> MediaKind:
    """``"image"``, ``"audio"`` or ``"video"``, decided by the file's content (never its extension).

    A GIF with several frames is a video; with one frame, an image.
    """
    p = check_file(path)
    try:
        with open(p, "rb") as fh:
            head = fh.read(16)
    except OSError as e:
        raise UserError(f"{path}: cannot read file ({' '.join(str(e).split())})") from None
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "video" if _gif_frames(p) > 1 else "image"
    kind = _sniff(head)
    if kind is not None:
        return kind
    # No signature we know: ask the decoders (headers only).
    try:
        with Image.open(p):
            return "image"
    except Image.DecompressionBombError:
        return "image"  # an image all right; load_image reports it as too large
    except Exception:  # UnidentifiedImageError, or a decoder choking on the header
        pass
    try:
        sf.info(str(p))
        return "audio"
    except Exception:
        pass
    raise UserError(f"{path}: neither an image, an audio nor a video file this program can read")


@dataclass
class Inputs:
    """Loaded media in the order given: each kind's list keeps its items' order, ``kinds`` the
    interleaving (e.g. ``["image", "video", "image"]``), which the user message follows."""

    images: list[Image.Image] = field(default_factory=list)
    audios: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)


def load_inputs(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    target_rate: int = 16_000,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    video_fps: float = DEFAULT_VIDEO_FPS,
    video_max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
) -> Inputs:
    """Load every path by its content kind. Images are tagged with their file
    (``info["source"]``), videos carry it in ``source``, so later errors can name them."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = Inputs()
    for path in paths:
        kind = media_kind(path)
        if kind == "image":
            image = load_image(path, max_pixels=max_pixels)
            image.info["source"] = str(path)
            out.images.append(image)
        elif kind == "video":
            out.videos.append(load_video(path, fps=video_fps, max_frames=video_max_frames, max_pixels=max_pixels))
        else:
            wave, _ = load_audio(path, target_rate)
            out.audios.append((wave, int(target_rate)))
        out.kinds.append(kind)
    return out


def load_media(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    target_rate: int = 16_000,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[list[Image.Image], list[tuple[torch.Tensor, int]]]:
    """Load image and audio paths by their content kind; order is kept within each kind.

    Returns ``(images, audios)``: RGB images, and ``(mono float32 wave, target_rate)`` pairs.
    A single path (str / PathLike) is accepted as well as a list. A video among them is a
    UserError naming it (``load_inputs`` takes every kind).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    images: list[Image.Image] = []
    audios: list[tuple[torch.Tensor, int]] = []
    for path in paths:
        kind = media_kind(path)
        if kind == "video":
            raise UserError(f"{path}: a video file: load it with load_inputs or load_video")
        if kind == "image":
            images.append(load_image(path, max_pixels=max_pixels))
        else:
            wave, _ = load_audio(path, target_rate)
            audios.append((wave, int(target_rate)))
    return images, audios


def content_hash(obj) -> str:
    """sha256 hex digest identifying a media item's content.

    Accepts a ``PIL.Image`` (pixel bytes + mode + size), a ``(wave, rate)`` pair
    (sample bytes + dtype + shape + rate), a ``Video`` (sampled frames + their timing), or a
    bare tensor / ndarray. Two images of the same size but different pixels always differ; so
    do the same samples at another rate.
    """
    if isinstance(obj, Video):
        return obj.digest()
    h = hashlib.sha256()
    if isinstance(obj, Image.Image):
        h.update(b"image\0")
        h.update(f"{obj.mode}\0{obj.size[0]}x{obj.size[1]}\0".encode())
        h.update(obj.tobytes())
        return h.hexdigest()
    if isinstance(obj, tuple) and len(obj) == 2 and not isinstance(obj[1], (torch.Tensor, np.ndarray)):
        wave, rate = obj
        h.update(b"audio\0")
        h.update(f"{rate}\0".encode())
        _update_array(h, wave)
        return h.hexdigest()
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        h.update(b"array\0")
        _update_array(h, obj)
        return h.hexdigest()
    raise TypeError(f"content_hash: unsupported object of type {type(obj).__name__}")


def _update_array(h, a) -> None:
    if isinstance(a, torch.Tensor):
        t = a.detach().cpu().contiguous()
        h.update(f"{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        arr = np.ascontiguousarray(a)
        h.update(f"{arr.dtype.str}\0{arr.shape}\0".encode())
        h.update(arr.tobytes())
