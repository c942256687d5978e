"""Video loading: a clip file -> frames sampled uniformly in time, with the timing the model needs.

Decoding is PyAV's (``av``), for three reasons: its wheels bundle FFmpeg, so nothing has to be
installed with apt; it reads MP4, WebM, MOV and animated GIF alike; and it is the default
backend of transformers' own ``load_video``, so the frames are the pixels the model's authors
expect (``rgb24`` from FFmpeg's converter).

Sampling: ``fps`` frames per second of the clip, uniformly in time (the frame on screen at
``start + k * duration / n``), at most ``max_frames`` and never more frames than the clip has.
The count is ``floor(duration * fps)`` (at least 1), the rule of transformers'
``default_sample_indices_fn``, so on a constant-rate clip both pick the same frames. A clip is
never cut: the cap only makes the sampling sparser. Two passes over the file: the first reads
packet timestamps only (no decoding) to learn the duration, the second decodes and keeps the
chosen frames, so a long clip never sits decoded in memory.

Every problem with the file (missing, not a video, corrupt, no decodable frame) is one
``UserError`` whose one-line message starts with the file's path.

The clip's own audio track is kept too (``Video.audio``: mono, at the file's rate), decoded at
load time so that it outlives the file (a served upload is deleted once read): a model that
hears video (Qwen2.5-Omni with ``media.use_audio_in_video``) takes it from there. A track
PyAV cannot decode leaves ``audio`` None rather than failing a clip only watched.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from pipeline.errors import UserError
from pipeline.media.images import DEFAULT_MAX_PIXELS, check_file, one_line

DEFAULT_VIDEO_FPS = 2.0
DEFAULT_VIDEO_MAX_FRAMES = 64
_EPS = 1e-6  # seconds: timestamps are rationals, targets floats; a frame starting "at" a target counts


@dataclass(eq=False)
class Video:
    """Sampled frames of a clip and where they sit in it (what a video processor needs).

    ``frames`` is ``[n, height, width, 3]`` uint8 RGB in time order; ``indices`` their rank
    among the source's ``total_frames`` decoded frames; ``timestamps`` their start in seconds
    from the clip's start; ``duration`` the seconds the source lasts (the span sampled from).
    """

    frames: np.ndarray
    indices: list[int]
    timestamps: list[float]
    total_frames: int
    duration: float
    source: str | None = None  # how messages name it: the file, or a request part
    audio: tuple[torch.Tensor, int] | None = None  # its own sound track: (mono float32 wave, rate), if any

    def __post_init__(self) -> None:
        f = self.frames
        if not isinstance(f, np.ndarray) or f.ndim != 4 or f.shape[-1] != 3 or f.dtype != np.uint8 or not len(f):
            raise ValueError("Video.frames must be a non-empty uint8 array of shape [n, height, width, 3]")
        if not (len(self.indices) == len(self.timestamps) == len(f)):
            raise ValueError("Video: one index and one timestamp per frame")
        if self.total_frames < 1 or self.duration < 0:
            raise ValueError("Video: total_frames must be >= 1 and duration >= 0")

    @classmethod
    def from_frames(
        cls,
        frames: Sequence[Image.Image | np.ndarray] | np.ndarray,
        fps: float,
        source: str | None = None,
        audio: tuple[torch.Tensor, int] | None = None,
    ) -> "Video":
        """A clip from frames already sampled at ``fps`` frames per second (Python API use), with
        its sound track ``(wave, rate)`` when it has one."""
        if not fps > 0:
            raise ValueError(f"fps must be > 0 (got {fps})")
        arrays = [np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in frames]
        if not arrays:
            raise ValueError("Video.from_frames: no frames")
        stacked = np.ascontiguousarray(np.stack(arrays).astype(np.uint8, copy=False))
        n = len(stacked)
        return cls(stacked, list(range(n)), [k / fps for k in range(n)], n, n / fps, source, audio)

    @property
    def info(self) -> dict:
        """``{"source": ...}`` like a PIL image's ``info``, so ``media_name`` names both alike."""
        return {"source": self.source} if self.source else {}

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the frames, as PIL reports image sizes."""
        return int(self.frames.shape[2]), int(self.frames.shape[1])

    @property
    def sampled_fps(self) -> float:
        """Sampled frames per second of the clip: what sets Qwen2.5-VL's temporal positions."""
        return self.num_frames / self.duration if self.duration > 0 else 1.0

    def metadata(self) -> dict[str, Any]:
        """``transformers.video_utils.VideoMetadata`` fields: the processor derives the sampled
        rate from them (``len(frames_indices) / total_num_frames * fps``), e.g. Qwen2.5-VL's
        ``second_per_grid_ts``. ``fps`` is the source's mean rate, so that ratio is exact
        whatever the clip's frame timing."""
        fps = self.sampled_fps * self.total_frames / self.num_frames  # = total_frames / duration
        return {
            "total_num_frames": int(self.total_frames),
            "fps": float(fps),
            "width": self.size[0],
            "height": self.size[1],
            "duration": float(self.duration),
            "video_backend": "pyav",
            "frames_indices": list(self.indices),
        }

    def digest(self) -> str:
        """sha256 of the sampled pixels and their timing: the KV-cache identity of the clip
        (the same frames at another rate get other positions on Qwen2.5-VL, so they differ)."""
        h = hashlib.sha256(b"video\0")
        h.update(f"{tuple(self.frames.shape)}\0{self.duration!r}\0{self.total_frames}\0".encode())
        h.update(np.asarray(self.indices, np.int64).tobytes())
        h.update(np.ascontiguousarray(self.frames).tobytes())
        return h.hexdigest()


def check_sampling(
    fps: Any, max_frames: Any, error: type[Exception] = ValueError, names: tuple[str, str] = ("fps", "max_frames")
) -> tuple[float, int]:
    """``(fps, max_frames)`` as numbers, or ``error`` naming the bad one (UserError for settings)."""
    try:
        rate = float(fps)
    except (TypeError, ValueError):
        rate = float("nan")
    if isinstance(fps, bool) or not math.isfinite(rate) or rate <= 0:
        raise error(f"{names[0]} must be a number > 0 (got {fps!r})")
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise error(f"{names[1]} must be a whole number >= 1 (got {max_frames!r})")
    return rate, max_frames


def frame_count(duration: float, fps: float, max_frames: int, available: int) -> int:
    """How many frames to sample: ``floor(duration * fps)``, at least 1, at most ``max_frames``
    and at most the ``available`` frames (sampling faster than the clip would only repeat them)."""
    return max(1, min(math.floor(duration * fps + _EPS), max_frames, available))


def load_video(
    path: str | os.PathLike,
    fps: float = DEFAULT_VIDEO_FPS,
    max_frames: int = DEFAULT_VIDEO_MAX_FRAMES,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Video:
    """Decode ``path`` and sample ``fps`` frames per second of it, at most ``max_frames``.

    Frames larger than ``max_pixels`` (the image decompression-bomb guard) are refused from the
    header. Transparent pixels (GIF) are composited on white, as still images are.
    """
    rate, cap = check_sampling(fps, max_frames)
    p = check_file(path)
    import av  # PyAV (FFmpeg) is slow to import: only when a video is read

    try:
        with av.open(str(p)) as container:
            stream = _video_stream(container, path)
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise UserError(
                    f"{path}: video frames are {width}x{height} = {width * height:,} pixels, over the limit of "
                    f"{max_pixels:,} (max_pixels)"
                )
            start, duration, packets = _timing(container, stream)
        if packets == 0:
            raise UserError(f"{path}: no video frames (zero decodable frames)")
        n = frame_count(duration, rate, cap, packets)
        targets = [start + k * duration / n for k in range(n)]
        with av.open(str(p)) as container:
            frames, indices, times, total = _decode(container, _video_stream(container, path), targets, start)
    except UserError:
        raise
    except MemoryError:
        raise UserError(f"{path}: not enough memory to decode this video") from None
    except Exception as e:  # av.FFmpegError (InvalidDataError, EOFError...), decoder surprises
        reason = getattr(e, "strerror", None) or one_line(e)  # FFmpeg's words, without errno and path
        raise UserError(f"{path}: corrupt or unreadable video ({reason})") from None
    if not frames:
        raise UserError(f"{path}: no video frames (zero decodable frames)")
    return Video(np.stack(frames), indices, [t - start for t in times], total, duration, str(path), load_audio_track(p))


def load_audio_track(path: str | os.PathLike) -> tuple[torch.Tensor, int] | None:
    """The first audio stream of a media file as ``(mono float32 wave, its rate)``, channels
    averaged as ``load_audio`` does; None when there is none or PyAV cannot decode it."""
    import av  # slow to import: only when a video is read

    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            to_float = av.AudioResampler(format="fltp")  # planar float, same layout and rate: exact
            parts: list[np.ndarray] = []
            for frame in container.decode(stream):
                parts += [f.to_ndarray() for f in to_float.resample(frame)]
            parts += [f.to_ndarray() for f in to_float.resample(None)]
            rate = int(stream.codec_context.sample_rate or stream.rate or 0)
    except Exception:  # av.FFmpegError and decoder surprises: the pictures are still good
        return None
    if not parts or rate <= 0:
        return None
    wave = np.concatenate(parts, axis=1).mean(axis=0, dtype=np.float32)
    return (torch.from_numpy(np.ascontiguousarray(wave)), rate) if wave.size and np.isfinite(wave).all() else None


def _video_stream(container: Any, path: str | os.PathLike) -> Any:
    if not container.streams.video:
        raise UserError(f"{path}: no video frames (zero decodable frames: the file has no video stream)")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"  # frame and slice threads: same pixels, faster
    return stream


def _timing(container: Any, stream: Any) -> tuple[float, float, int]:
    """(start s, duration s, packets) from the packets' timestamps, without decoding anything."""
    base = float(stream.time_base) if stream.time_base else 0.0
    times: list[float] = []
    last_end = None
    count = 0
    for packet in container.demux(stream):
        if packet.size == 0:  # the demuxer's flush packet
            continue
        count += 1
        stamp = packet.pts if packet.pts is not None else packet.dts
        if stamp is None or not base:
            continue
        t = stamp * base
        times.append(t)
        end = t + (packet.duration or 0) * base
        last_end = end if last_end is None else max(last_end, end)
    if times and len(times) == count:
        start = min(times)
        if last_end is not None and last_end > max(times):
            return start, last_end - start, count
        ordered = sorted(times)
        step = float(np.median(np.diff(ordered))) if len(ordered) > 1 else 0.0
        if ordered[-1] + step > start:
            return start, ordered[-1] + step - start, count
    mean_rate = float(stream.average_rate or stream.guessed_rate or 0) or 25.0
    return 0.0, count / mean_rate, count  # no usable timestamps: assume a constant rate


def _decode(
    container: Any, stream: Any, targets: list[float], start: float
) -> tuple[list[np.ndarray], list[int], list[float], int]:
    """Decode in presentation order, keeping for each target time the frame on screen then.

    Returns (frames, their ranks, their start times, frames decoded in all). A frame is only
    converted to RGB when some target falls on it; one frame is held back at a time.
    """
    base = float(stream.time_base) if stream.time_base else 0.0
    rate = float(stream.average_rate or stream.guessed_rate or 0) or 25.0
    frames: list[np.ndarray] = []
    indices: list[int] = []
    times: list[float] = []
    k = 0  # next target
    previous = None  # (rank, time, frame) of the last decoded frame
    rank = -1
    for rank, frame in enumerate(container.decode(stream)):
        t = frame.pts * base if frame.pts is not None and base else start + rank / rate
        while previous is not None and k < len(targets) and targets[k] < t - _EPS:
            _keep(previous, frames, indices, times)
            k += 1
        previous = (rank, max(t, start), frame)
    while previous is not None and k < len(targets):  # the last frame stays on screen to the end
        _keep(previous, frames, indices, times)
        k += 1
    return frames, indices, times, rank + 1


def _keep(previous: tuple[int, float, Any], frames: list, indices: list, times: list) -> None:
    rank, t, frame = previous
    if indices and indices[-1] == rank:  # the same frame on screen at two targets
        frames.append(frames[-1])
    else:
        frames.append(_rgb(frame))
    indices.append(rank)
    times.append(t)


def _rgb(frame: Any) -> np.ndarray:
    """[H, W, 3] uint8 RGB; transparency composited on white (as ``to_rgb`` does for images)."""
    if any(c.is_alpha for c in frame.format.components):
        rgba = frame.to_ndarray(format="rgba").astype(np.uint16)
        alpha = rgba[..., 3:4]
        return ((rgba[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    return frame.to_ndarray(format="rgb24")
