"""Media in requests (images, videos, audio) -> what the pipeline takes: base64 data URIs,
``file://`` paths under ``serve.allowed_media_dir``, remote URLs only when
``serve.allow_remote_media`` is on, and then never from a loopback, private or link-local address
(``pipeline.serve.fetch``) unless ``serve.allowed_media_domains`` names the host.

Decoding goes through the CLI's own loaders (``pipeline.media``), so every bad file gets the same
one-line diagnosis, here naming the request part (``messages[1].content[0]``) instead of a path.
"""

from __future__ import annotations

import base64
import binascii
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import UserError
from pipeline.media import load_audio, load_image, load_video, media_kind
from pipeline.serve.fetch import RefusedAddress, fetch


@dataclass
class MediaPolicy:
    """What a request may reference, and how much of it."""

    allowed_dir: Path | None = None
    allow_remote: bool = False
    allowed_domains: frozenset[str] = frozenset()  # hosts fetched even at a non-public address
    max_images: int = 8
    max_audios: int = 4
    max_videos: int = 2
    max_image_pixels: int = 64_000_000  # also bounds a video's frame size
    max_audio_s: float = 600.0
    max_remote_bytes: int = 32 << 20
    video_fps: float = 2.0  # media.video_fps: frames sampled per second of a clip
    video_max_frames: int = 64  # media.video_max_frames


def _b64(data: str, where: str) -> bytes:
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{where}: not valid base64") from None
    if not raw:
        raise UserError(f"{where}: empty media data")
    return raw


def _decoded(raw: bytes, where: str, load: Callable[[str], Any]) -> Any:
    """Run a path-based loader on bytes, its errors naming ``where`` instead of a temporary file."""
    with tempfile.TemporaryDirectory(prefix="mm-serve-") as tmp:
        path = Path(tmp) / "upload"
        path.write_bytes(raw)
        try:
            return load(str(path))
        except UserError as err:
            raise UserError(str(err).replace(str(path), where)) from None


def _local(url: str, where: str, policy: MediaPolicy) -> str:
    if policy.allowed_dir is None:
        raise UserError(f"{where}: file:// URLs are disabled (set serve.allowed_media_dir to a folder to allow them)")
    path = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()
    root = policy.allowed_dir.resolve()
    if not path.is_relative_to(root):
        raise UserError(f"{where}: {path} is outside serve.allowed_media_dir ({root})")
    return str(path)


def _remote(url: str, where: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_remote:
        raise UserError(f"{where}: remote media URLs are disabled (serve.allow_remote_media=false); send a data: URI")
    try:
        raw = fetch(url, policy.max_remote_bytes, policy.allowed_domains)
    except Exception as err:  # urllib raises URLError, HTTPError, timeouts, ValueError...
        refused = getattr(err, "reason", err)
        if isinstance(refused, RefusedAddress):
            raise UserError(
                f"{where}: {url} not fetched: {refused} (serve.allowed_media_domains names hosts to allow)"
            ) from None
        raise UserError(f"{where}: cannot fetch {url} ({err})") from None
    if len(raw) > policy.max_remote_bytes:
        raise UserError(f"{where}: {url} is over {policy.max_remote_bytes} bytes")
    return raw


def _from_url(url: str, where: str, policy: MediaPolicy, kind: str, load: Callable[[str], Any]) -> Any:
    """A media URL through ``load``: a base64 data: URI, a file:// path under the allowed
    folder, or a remote URL when remote media are allowed."""
    if url.startswith("data:"):
        header, sep, data = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise UserError(f"{where}: only base64 data: URIs are accepted (data:{kind}/...;base64,...)")
        return _decoded(_b64(data, where), where, load)
    if url.startswith("file://"):
        return load(_local(url, where, policy))
    if url.startswith(("http://", "https://")):
        return _decoded(_remote(url, where, policy), where, load)
    raise UserError(f"{where}: unsupported {kind} URL (data:, file:// or http(s)://)")


def _checked_kind(path: str, kind: str) -> None:
    """The file's content must be ``kind`` (a video sent as image_url is named, not misread)."""
    actual = media_kind(path)
    if actual != kind:
        raise UserError(f"{path}: {'an' if actual[0] in 'aeiou' else 'a'} {actual} file, sent as {kind}")


def image_from_url(url: str, where: str, policy: MediaPolicy) -> Any:
    """An ``image_url`` part -> an RGB PIL image (bomb guard and decoding as the CLI's)."""

    def load(path: str) -> Any:
        return load_image(path, max_pixels=policy.max_image_pixels)

    image = _from_url(url, where, policy, "image", load)
    image.info["source"] = where
    return image


def video_from_url(url: str, where: str, policy: MediaPolicy) -> Any:
    """A ``video_url`` part -> a ``Video`` sampled as the CLI samples (``media.video_fps``,
    ``media.video_max_frames``), frames under the image pixel guard."""

    def load(path: str) -> Any:
        _checked_kind(path, "video")
        return load_video(
            path, fps=policy.video_fps, max_frames=policy.video_max_frames, max_pixels=policy.max_image_pixels
        )

    video = _from_url(url, where, policy, "video", load)
    video.source = where
    return video


def _audio(decoded: tuple[Any, float], where: str, rate: int, policy: MediaPolicy) -> tuple[Any, int]:
    """A decoded clip as (wave, rate), refused when over ``max_audio_s``."""
    wave, seconds = decoded
    if seconds > policy.max_audio_s:
        raise UserError(f"{where}: audio is {seconds:.1f} s, over serve.max_audio_s ({policy.max_audio_s:g} s)")
    return wave, rate


def audio_from_base64(data: str, where: str, rate: int, policy: MediaPolicy) -> tuple[Any, int]:
    """An ``input_audio`` part -> (1-D float waveform at ``rate``, rate), at most ``max_audio_s``."""
    return audio_from_bytes(_b64(data, where), where, rate, policy)


def audio_from_bytes(raw: bytes, where: str, rate: int, policy: MediaPolicy) -> tuple[Any, int]:
    """An uploaded audio file (``/v1/audio/transcriptions``' ``file``) -> (wave at ``rate``, rate),
    decoded and limited as ``input_audio`` parts are."""
    if not raw:
        raise UserError(f"{where}: empty media data")
    return _audio(_decoded(raw, where, lambda path: load_audio(path, rate)), where, rate, policy)


def audio_from_url(url: str, where: str, rate: int, policy: MediaPolicy) -> tuple[Any, int]:
    """An ``audio_url`` part (vLLM's extension) -> (wave at ``rate``, rate): the URL rules of
    ``image_url`` (data:, file:// under the allowed folder, http(s) when remote media are allowed)."""

    def load(path: str) -> tuple[Any, float]:
        _checked_kind(path, "audio")
        return load_audio(path, rate)

    return _audio(_from_url(url, where, policy, "audio", load), where, rate, policy)
