"""Audio loading: WAV / FLAC / OGG-Vorbis / MP3 (and anything else libsndfile reads) ->
a 1-D float32 mono waveform at the rate an encoder wants.

Decoding uses ``soundfile`` (libsndfile). ``torchaudio.load`` is deliberately not used:
since torchaudio 2.9 it goes through torchcodec/FFmpeg, which this project does not ship.
torchaudio is used only for DSP (resampling), and imported only when needed.
"""

from __future__ import annotations

import math

import os

import numpy as np
import soundfile as sf
import torch

from pipeline.errors import UserError
from pipeline.media.images import check_file, one_line


def load_audio(path: str | os.PathLike, target_rate: int) -> tuple[torch.Tensor, float]:
    """Decode ``path``, mix to mono (mean over channels) and resample to ``target_rate``.

    Returns ``(wave, duration_s)``: ``wave`` is a 1-D float32 tensor in [-1, 1] at
    ``target_rate``; ``duration_s`` is the source's length in seconds (frames / its rate).
    """
    if int(target_rate) != target_rate or target_rate <= 0:
        raise UserError(f"target sample rate must be a positive integer, got {target_rate!r}")
    target_rate = int(target_rate)
    p = check_file(path)
    try:
        with sf.SoundFile(str(p)) as f:
            rate = int(f.samplerate)
            data = f.read(dtype="float32", always_2d=True)  # (frames, channels)
    except sf.LibsndfileError as e:
        raise UserError(f"{path}: {_describe_libsndfile_error(p, e)}") from None
    except MemoryError:
        raise UserError(f"{path}: not enough memory to decode this audio") from None
    except Exception as e:  # soundfile also raises RuntimeError/ValueError/TypeError on odd files
        raise UserError(f"{path}: cannot decode audio ({one_line(e)})") from None

    if data.shape[0] == 0 or data.shape[1] == 0:
        raise UserError(f"{path}: audio file contains no samples")
    if rate <= 0:
        raise UserError(f"{path}: invalid sample rate {rate} in header")
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    wave = torch.from_numpy(np.ascontiguousarray(mono, dtype=np.float32))
    if not bool(torch.isfinite(wave).all()):
        raise UserError(f"{path}: audio contains NaN or infinite samples")
    return resample(wave, rate, target_rate), data.shape[0] / rate


def resample(wave: torch.Tensor, rate: int, target_rate: int) -> torch.Tensor:
    """``wave`` (1-D float) from ``rate`` to ``target_rate`` Hz; unchanged when they agree."""
    if rate == target_rate:
        return wave
    import torchaudio.functional as AF  # DSP only; slow to import, so only when needed

    return AF.resample(wave, rate, target_rate).contiguous()


def split_audio(wave: torch.Tensor, rate: int, window_s: float) -> list[torch.Tensor]:
    """Cut ``wave`` (1-D) into the fewest equal chunks of at most ``window_s`` seconds.

    For encoders with a fixed input window (Qwen2-Audio / Whisper: 30 s). Equal chunks rather
    than full windows plus a remainder, so no tail is too short to encode; concatenated, the
    chunks are the wave again. An empty wave gives ``[]``.
    """
    if wave.dim() != 1:
        raise ValueError(f"split_audio expects a 1-D waveform, got shape {tuple(wave.shape)}")
    n = int(round(window_s * rate))
    if n < 1:
        raise ValueError(f"window of {window_s} s at {rate} Hz is shorter than one sample")
    if wave.numel() == 0:
        return []
    return [p.contiguous() for p in torch.tensor_split(wave, math.ceil(wave.numel() / n))]


def _describe_libsndfile_error(path, e: sf.LibsndfileError) -> str:
    """libsndfile's reason, reworded where its own words mislead, on one line."""
    reason = one_line(getattr(e, "error_string", "") or e)
    try:
        with open(path, "rb") as fh:
            head = fh.read(12)
    except OSError:
        head = b""
    is_wav = head[:4] in (b"RIFF", b"RIFX", b"RF64") and head[8:12] == b"WAVE"
    low = reason.lower()
    if "not recognised" in low or "unknown format" in low:
        return f"not an audio file, or an audio format libsndfile cannot read (libsndfile: {reason})"
    if is_wav:
        # libsndfile's words here are often misleading: an unknown format code is reported
        # as a "malformed 'fmt ' chunk", 16-bit IEEE float as an "unspecified internal error".
        return f"unsupported WAV sample format or codec, or a malformed WAV header (libsndfile: {reason})"
    if "unimplemented format" in low:  # e.g. a FLAC with a wrecked STREAMINFO block
        return f"unsupported sample format or codec, or a corrupt header (libsndfile: {reason})"
    return f"corrupt or unreadable audio file (libsndfile: {reason})"
