"""pipeline.media: loading images and audio by content, conversions, errors, hashing."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image, ImageFile

from pipeline.errors import UserError
from pipeline.media import (
    content_hash,
    load_audio,
    load_image,
    load_media,
    media_kind,
    split_audio,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def pixels(im: Image.Image) -> np.ndarray:
    return np.asarray(im)


def assert_user_error(exc_info, path: Path, *words: str) -> str:
    msg = str(exc_info.value)
    assert path.name in msg, msg
    assert "\n" not in msg, msg
    for w in words:
        assert w.lower() in msg.lower(), msg
    return msg


# ---------------------------------------------------------------- image fixtures / helpers


def scene(w: int = 64, h: int = 48) -> Image.Image:
    """Four flat quadrants (few colours, so GIF's palette keeps them exactly)."""
    a = np.zeros((h, w, 3), np.uint8)
    a[: h // 2, : w // 2] = (255, 0, 0)
    a[: h // 2, w // 2 :] = (0, 255, 0)
    a[h // 2 :, : w // 2] = (0, 0, 255)
    a[h // 2 :, w // 2 :] = (250, 250, 250)
    return Image.fromarray(a, "RGB")


def png_header_only(path: Path, w: int, h: int) -> Path:
    """A PNG whose IHDR claims w x h but whose data is a few bytes: cheap bomb stand-in."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    )
    return path


# ---------------------------------------------------------------- images: formats


@pytest.mark.parametrize(
    "fmt, ext, kwargs, exact",
    [
        ("PNG", "png", {}, True),
        ("JPEG", "jpg", {"quality": 95}, False),
        ("WEBP", "webp", {"lossless": True}, True),
        ("GIF", "gif", {}, True),
        ("BMP", "bmp", {}, True),
        ("TIFF", "tif", {}, True),
    ],
)
def test_formats_load_to_rgb(tmp_path, fmt, ext, kwargs, exact):
    src = scene()
    path = tmp_path / f"img.{ext}"
    src.save(path, fmt, **kwargs)
    im = load_image(path)
    assert im.mode == "RGB" and im.size == (64, 48)
    diff = np.abs(pixels(im).astype(int) - pixels(src).astype(int))
    assert diff.max() == 0 if exact else diff.mean() < 3


def test_gif_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 0, 255)]]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert tuple(pixels(load_image(path))[0, 0]) == (255, 0, 0)


def test_exif_orientation_applied(tmp_path):
    src = scene(64, 48)
    stored = src.transpose(Image.Transpose.ROTATE_90)  # 48x64 on disk
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    path = tmp_path / "rot.jpg"
    stored.save(path, quality=95, exif=exif.tobytes())
    im = load_image(path)
    assert im.size == (64, 48)
    assert np.abs(pixels(im).astype(int) - pixels(src).astype(int)).mean() < 3


def test_examples_load():
    import importlib.util

    from pipeline.tiny.shapes import example

    spec = importlib.util.spec_from_file_location("make_examples", EXAMPLES / "make_examples.py")
    make_examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_examples)
    shapes = load_image(EXAMPLES / "shapes.png")  # the embedded default's task (tests/test_shapes.py)
    assert pixels(shapes).tobytes() == pixels(example()[0]).tobytes()
    photo = load_image(EXAMPLES / "photo.jpg")
    scene = make_examples.draw_scene()
    assert photo.size == scene.size == (320, 240)
    assert np.abs(pixels(scene).astype(int) - pixels(photo).astype(int)).mean() < 4  # upright, as drawn
    with Image.open(EXAMPLES / "photo.jpg") as raw:
        assert raw.size == (240, 320)  # really stored sideways
    wave, dur = load_audio(EXAMPLES / "tone.wav", 16_000)
    assert dur == 2.0 and wave.shape == (32_000,)
    lines = (EXAMPLES / "prompts.txt").read_text().splitlines()
    prompts = [line for line in lines if line.strip() and not line.startswith("#")]
    assert len(prompts) == 5
    assert sum(p.stat().st_size for p in EXAMPLES.iterdir()) < 200_000


# ---------------------------------------------------------------- images: conversions


def test_palette_with_transparency_on_white(tmp_path):
    im = Image.new("P", (2, 1))
    im.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    im.putpixel((0, 0), 0)
    im.putpixel((1, 0), 1)
    path = tmp_path / "pal.png"
    im.save(path, transparency=0)
    px = pixels(load_image(path))
    assert tuple(px[0, 0]) == (255, 255, 255)  # transparent index -> white
    assert tuple(px[0, 1]) == (0, 0, 255)


def test_plain_palette(tmp_path):
    im = Image.new("P", (1, 1))
    im.putpalette([10, 20, 30] + [0] * 765)
    path = tmp_path / "pal.gif"
    im.save(path)
    assert tuple(pixels(load_image(path))[0, 0]) == (10, 20, 30)


def test_rgba_and_la_composited_on_white(tmp_path):
    a = np.array([[[255, 0, 0, 0], [255, 0, 0, 255], [0, 0, 0, 128]]], np.uint8)
    path = tmp_path / "rgba.png"
    Image.fromarray(a, "RGBA").save(path)
    px = pixels(load_image(path)).astype(int)
    assert tuple(px[0, 0]) == (255, 255, 255)
    assert tuple(px[0, 1]) == (255, 0, 0)
    assert np.all(np.abs(px[0, 2] - 127) <= 1)

    la = np.array([[[0, 0], [50, 255]]], np.uint8)
    path = tmp_path / "la.png"
    Image.fromarray(la, "LA").save(path)
    px = pixels(load_image(path))
    assert tuple(px[0, 0]) == (255, 255, 255) and tuple(px[0, 1]) == (50, 50, 50)


def test_cmyk(tmp_path):
    im = Image.new("CMYK", (3, 1))
    for x, c in enumerate([(0, 0, 0, 0), (255, 0, 0, 0), (0, 0, 0, 255)]):
        im.putpixel((x, 0), c)
    path = tmp_path / "cmyk.tif"
    im.save(path)
    px = pixels(load_image(path))
    assert [tuple(p) for p in px[0]] == [(255, 255, 255), (0, 255, 255), (0, 0, 0)]
    path = tmp_path / "cmyk.jpg"  # Adobe-inverted CMYK JPEG
    Image.new("CMYK", (8, 8), (255, 0, 0, 0)).save(path, quality=100)
    assert np.all(np.abs(pixels(load_image(path))[0, 0].astype(int) - (0, 255, 255)) <= 3)


@pytest.mark.parametrize(
    "mode, values, expected",
    [
        ("L", np.array([[0, 100, 255]], np.uint8), [0, 100, 255]),
        ("I;16", np.array([[0, 32768, 65535]], np.uint16), [0, 128, 255]),
        ("I", np.array([[0, 32768, 65535]], np.int32), [0, 128, 255]),
        ("I", np.array([[0, 100, 255]], np.int32), [0, 100, 255]),
        ("F", np.array([[0.0, 0.5, 1.0]], np.float32), [0, 128, 255]),
        ("F", np.array([[0.0, 100.0, 255.0]], np.float32), [0, 100, 255]),
    ],
)
def test_grey_modes(tmp_path, mode, values, expected):
    im = Image.fromarray(values) if mode != "I" else Image.fromarray(values, "I")
    assert im.mode == mode
    path = tmp_path / "grey.tif"
    im.save(path)
    with Image.open(path) as raw:
        assert raw.mode == mode
    px = pixels(load_image(path))
    assert px.shape == (1, 3, 3)
    assert px[0, :, 0].tolist() == expected and (px[0, :, 0] == px[0, :, 2]).all()


def test_sixteen_bit_png(tmp_path):
    path = tmp_path / "g16.png"
    Image.fromarray(np.array([[0, 65535]], np.uint16)).save(path)
    assert pixels(load_image(path))[0, :, 1].tolist() == [0, 255]


# ---------------------------------------------------------------- images: errors


def test_image_errors(tmp_path):
    cases = {}
    cases["missing"] = (tmp_path / "nope.png", "not found")
    (tmp_path / "adir.png").mkdir()
    cases["dir"] = (tmp_path / "adir.png", "directory")
    (tmp_path / "notes.jpg").write_text("this is not an image\n" * 20)
    cases["text"] = (tmp_path / "notes.jpg", "not an image")
    (tmp_path / "zero.png").write_bytes(b"")
    cases["zero"] = (tmp_path / "zero.png", "empty")
    good = tmp_path / "good.jpg"
    scene(256, 256).save(good, quality=90)
    data = good.read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[: len(data) // 2])
    cases["truncated"] = (tmp_path / "trunc.jpg", "truncated")
    sof = data.index(b"\xff\xc0")  # wreck the frame header
    (tmp_path / "corrupt.jpg").write_bytes(data[:sof] + b"\xff\xc0\x00\x03\x00" + data[sof + 5 :])
    cases["corrupt"] = (tmp_path / "corrupt.jpg", "corrupt")
    for name, (path, word) in cases.items():
        with pytest.raises(UserError) as e:
            load_image(path)
        assert_user_error(e, path, word)


def test_truncated_detected_even_if_global_flag_on(tmp_path, monkeypatch):
    good = tmp_path / "good.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(good)
    path = tmp_path / "trunc.png"
    path.write_bytes(good.read_bytes()[:3000])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(UserError) as e:
        load_image(path)
    assert_user_error(e, path)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored


def test_pixel_limit(tmp_path):
    small = tmp_path / "small.png"
    scene(64, 48).save(small)
    with pytest.raises(UserError) as e:
        load_image(small, max_pixels=1000)
    assert_user_error(e, small, "max_pixels")
    assert load_image(small, max_pixels=64 * 48).size == (64, 48)

    # 9000x9000 = 81 M: under Pillow's own limit, over our default 64 M. The data is junk,
    # so only a check made from the header, before decoding, gives this message.
    big = png_header_only(tmp_path / "big.png", 9000, 9000)
    with pytest.raises(UserError) as e:
        load_image(big)
    assert_user_error(e, big, "9000x9000", "limit")


@pytest.mark.parametrize("side", [9500, 20000])  # Pillow's warning, then its error
def test_pillow_decompression_bomb_is_user_error(tmp_path, side):
    bomb = png_header_only(tmp_path / "bomb.png", side, side)
    with pytest.raises(UserError) as e:
        load_image(bomb, max_pixels=10**9 if side > 10000 else 64_000_000)
    assert_user_error(e, bomb)
    assert media_kind(bomb) == "image"


# ---------------------------------------------------------------- audio helpers


def sine(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def hand_wav(path: Path, fmt_code: int, bits: int, data: bytes = b"\x00\x01" * 100, rate: int = 16000) -> Path:
    block = (bits + 7) // 8
    fmt = struct.pack("<HHIIHH", fmt_code, 1, rate, rate * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path


def write_or_skip(path: Path, data, rate: int, fmt: str, subtype: str) -> None:
    try:
        sf.write(path, data, rate, format=fmt, subtype=subtype)
    except Exception as e:  # libsndfile built without this codec
        pytest.skip(f"this libsndfile ({sf.__libsndfile_version__}) cannot write {fmt}/{subtype}: {e}")


# ---------------------------------------------------------------- audio: decoding


def test_wav_and_flac_identical(tmp_path):
    # Write int16 samples: libsndfile's float->PCM_16 rounding differs by 1 LSB between its
    # WAV and FLAC writers, so float input would not store the same sound in both files.
    x = np.round(sine(440, 16000, 0.5) * 32767).astype(np.int16)
    sf.write(tmp_path / "a.wav", x, 16000, subtype="PCM_16")
    sf.write(tmp_path / "a.flac", x, 16000, subtype="PCM_16")
    w, dw = load_audio(tmp_path / "a.wav", 16000)
    f, df = load_audio(tmp_path / "a.flac", 16000)
    assert w.dtype == torch.float32 and w.dim() == 1 and w.shape == (8000,)
    assert torch.equal(w, f) and dw == df == 0.5
    assert torch.equal(w, torch.from_numpy(x.astype(np.float32) / 32768))


@pytest.mark.parametrize("fmt, subtype, ext", [("OGG", "VORBIS", "ogg"), ("MP3", "MPEG_LAYER_III", "mp3")])
def test_lossy_formats_decode(tmp_path, fmt, subtype, ext):
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile ({sf.__libsndfile_version__}) has no {fmt} support")
    x = sine(440, 16000, 1.0)
    path = tmp_path / f"a.{ext}"
    write_or_skip(path, x, 16000, fmt, subtype)
    assert media_kind(path) == "audio"
    wave, dur = load_audio(path, 16000)
    assert wave.dtype == torch.float32 and wave.dim() == 1
    assert abs(dur - 1.0) < 0.1 and abs(wave.numel() - 16000) < 1600
    # energy of a 0.5-amplitude sine: RMS ~0.354 (MP3 adds encoder delay / padding)
    rms = wave.pow(2).mean().sqrt().item()
    assert 0.25 < rms < 0.42


def test_stereo_44k_to_mono_16k(tmp_path):
    left = sine(300, 44100, 1.5)
    stereo = np.stack([left, 0.5 * left], axis=1)  # mean = 0.75 * left
    path = tmp_path / "st.wav"
    sf.write(path, stereo, 44100, subtype="FLOAT")
    wave, dur = load_audio(path, 16000)
    assert wave.shape == (24000,) and wave.dtype == torch.float32
    assert dur == pytest.approx(1.5)
    expected = torch.from_numpy(0.75 * sine(300, 16000, 1.5))
    assert (wave[200:-200] - expected[200:-200]).abs().max() < 0.01


def test_split_audio():
    wave = torch.arange(65 * 100, dtype=torch.float32)
    chunks = split_audio(wave, 100, 30)
    assert [c.numel() for c in chunks] == [2167, 2167, 2166]  # equal chunks: no tiny tail
    assert torch.equal(torch.cat(chunks), wave)
    assert split_audio(torch.zeros(0), 100, 30) == []
    assert len(split_audio(torch.zeros(3000), 100, 30)) == 1


# ---------------------------------------------------------------- audio: errors


def test_audio_errors(tmp_path):
    good = tmp_path / "good.flac"
    sf.write(good, sine(440, 16000, 1.0), 16000, subtype="PCM_16")
    data = good.read_bytes()
    (tmp_path / "adir.wav").mkdir()
    (tmp_path / "words.wav").write_text("not audio at all\n" * 20)
    (tmp_path / "zero.wav").write_bytes(b"")
    (tmp_path / "badhead.flac").write_bytes(data[:4] + b"\x00" * 30 + data[34:])
    (tmp_path / "trunc.flac").write_bytes(data[: len(data) // 2])
    cases = [
        (tmp_path / "missing.wav", "not found"),
        (tmp_path / "adir.wav", "directory"),
        (tmp_path / "words.wav", "not an audio"),
        (tmp_path / "zero.wav", "empty"),
        (tmp_path / "badhead.flac", "corrupt header"),
        (tmp_path / "trunc.flac", ""),
        (hand_wav(tmp_path / "nosamples.wav", 1, 16, data=b""), "no samples"),
        (hand_wav(tmp_path / "pcm48.wav", 1, 48), "unsupported"),  # libsndfile: unimplemented
        (hand_wav(tmp_path / "code1234.wav", 0x1234, 16), "unsupported"),  # unknown format code
        (hand_wav(tmp_path / "float16.wav", 3, 16), "unsupported"),  # 16-bit IEEE float
    ]
    for path, word in cases:
        with pytest.raises(UserError) as e:
            load_audio(path, 16000)
        assert_user_error(e, path, word)


# ---------------------------------------------------------------- kind, load_media, hashing


def test_media_kind_by_content(tmp_path):
    png_as_wav = tmp_path / "picture.wav"
    scene().save(png_as_wav, "PNG")
    wav_as_png = tmp_path / "sound.png"
    sf.write(wav_as_png, sine(440, 8000, 0.1), 8000, format="WAV")
    flac_as_jpg = tmp_path / "sound.jpg"
    sf.write(flac_as_jpg, sine(440, 8000, 0.1), 8000, format="FLAC")
    tga = tmp_path / "noext"  # no magic we sniff: decided by asking Pillow
    scene().save(tga, "TGA")
    assert media_kind(png_as_wav) == "image"
    assert media_kind(wav_as_png) == "audio"
    assert media_kind(flac_as_jpg) == "audio"
    assert media_kind(tga) == "image"
    assert load_image(png_as_wav).size == (64, 48)
    text = tmp_path / "readme.png"
    text.write_text("hello\n")
    with pytest.raises(UserError) as e:
        media_kind(text)
    assert_user_error(e, text)
    with pytest.raises(UserError) as e:
        media_kind(tmp_path / "missing.png")
    assert_user_error(e, tmp_path / "missing.png", "not found")


def test_load_media_keeps_order(tmp_path):
    paths = []
    for i, (kind, v) in enumerate([("img", 10), ("aud", 0.1), ("img", 20), ("aud", 0.2)]):
        p = tmp_path / f"m{i}.bin"
        if kind == "img":
            Image.new("RGB", (4, 4), (v, v, v)).save(p, "PNG")
        else:
            sf.write(p, np.full(800, v, np.float32), 8000, format="WAV", subtype="FLOAT")
        paths.append(p)
    images, audios = load_media(paths, target_rate=8000)
    assert [pixels(im)[0, 0, 0] for im in images] == [10, 20]
    assert [round(w[0].item(), 3) for w, _ in audios] == [0.1, 0.2]
    assert all(r == 8000 for _, r in audios)
    images, audios = load_media(str(paths[0]))
    assert len(images) == 1 and audios == []


def test_content_hash():
    a = Image.new("RGB", (8, 8), (0, 0, 0))
    b = a.copy()
    b.putpixel((7, 7), (0, 0, 1))
    assert content_hash(a) != content_hash(b)
    assert content_hash(a) == content_hash(a.copy())
    assert content_hash(a) != content_hash(Image.new("RGB", (4, 16), (0, 0, 0)))  # same bytes, other size
    w = torch.linspace(-1, 1, 100)
    assert content_hash((w, 16000)) == content_hash((w.clone(), 16000))
    assert content_hash((w, 16000)) != content_hash((w, 8000))
    w2 = w.clone()
    w2[50] += 1e-3
    assert content_hash((w, 16000)) != content_hash((w2, 16000))
    assert len(content_hash(a)) == 64
