"""TextStream: pushing an answer's ids one at a time gives exactly the full decode.

Property-style, with seeded random texts (emoji, CJK, accents, random code points) and random
special tokens: every intermediate ``text`` is a prefix of the final one and never ends in half
a character, and the last one equals ``tokenizer.decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel

from pipeline.engine.output import Output, TextStream, _fast_backend

CHARS = "abcxyz XYZ 019 .,!?'\n\téèçñüßøå中文字符测试漢字かなカナ한국어😀🎉👍🏽🇫🇷\u200d\ufe0fΩπ∑√∞€"


def random_text(rng: random.Random) -> str:
    """Mostly chars from CHARS, sometimes any code point up to plane 2 (4-byte UTF-8 too)."""
    out = []
    for _ in range(rng.randrange(1, 40)):
        if rng.random() < 0.15:
            cp = rng.randrange(0x80, 0x30000)
            out.append(chr(cp) if not 0xD800 <= cp < 0xE000 else "\u00e9")  # no lone surrogates
        else:
            out.append(rng.choice(CHARS))
    return "".join(out)


def streamed(tokenizer, ids: list[int]) -> list[str]:
    """``text`` after each push."""
    stream = TextStream(tokenizer)
    texts = []
    for i in ids:
        stream.push(i)
        texts.append(stream.text)
    return texts


def check_stream(tokenizer, ids: list[int]) -> str:
    """Stream ``ids`` and check it against the full decode; the decoded text."""
    final = tokenizer.decode(ids, skip_special_tokens=True)
    texts = streamed(tokenizer, ids)
    for before, after in zip([""] + texts, texts):
        assert after.startswith(before), (ids, before, after)  # only grows
        assert final.startswith(after), (ids, after, final)
        assert not after.endswith("\ufffd"), (ids, after)
    if not final.endswith("\ufffd"):  # an answer cut inside a character stays held back
        assert texts[-1] == final, (ids, texts[-1], final)
    return final


def with_specials(rng: random.Random, ids: list[int], specials: list[int]) -> list[int]:
    """``ids`` with special tokens inserted anywhere, even between the bytes of one character."""
    out = list(ids)
    for _ in range(rng.randrange(1, 5)):
        out.insert(rng.randrange(len(out) + 1), rng.choice(specials))
    return out


class DecodeOnly:
    """A tokenizer seen through ``decode`` alone: TextStream must take its window path."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request):
    """The project's byte-level BPE tokenizer (Qwen2Tokenizer; llama's fast one, which adds BOS)."""
    from pipeline.testing.tokenizer import make_tokenizer

    return make_tokenizer(request.param)


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    """A Llama-2-style tokenizer: "▁" for spaces, <0xNN> tokens for characters outside its tiny
    vocabulary, and a decoder that strips the leading space (so a window needs context)."""
    from tokenizers import normalizers
    from tokenizers.models import BPE

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in [*"▁abcdefghijklmnopqrstuvwxyzé.,!?", "▁a"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(BPE(vocab, merges=[("▁", "a")], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="module")
def byt5():
    """A tokenizer with no ``tokenizers`` backend: one token per UTF-8 byte, plus specials."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def test_fast_tokenizers_use_decode_stream(tiny, byt5):
    assert _fast_backend(tiny) is tiny.backend_tokenizer
    assert _fast_backend(byt5) is None and _fast_backend(DecodeOnly(tiny)) is None


@pytest.mark.parametrize("window", [False, True], ids=["decode_stream", "window"])
def test_multibyte_text_streams_exactly(tiny, window):
    tok = DecodeOnly(tiny) if window else tiny
    rng = random.Random(0)
    for _ in range(150):
        text = random_text(rng)
        ids = tiny.encode(text, add_special_tokens=False)
        assert check_stream(tok, ids) == tiny.decode(ids)


def test_half_characters_are_held_back(tiny):
    ids = tiny.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # the emoji is split across byte tokens
    assert streamed(tiny, ids)[:-1] == ["a"] * (len(ids) - 1)
    assert streamed(tiny, ids)[-1] == "a😀"


@pytest.mark.parametrize("window", [False, True], ids=["decode_stream", "window"])
def test_special_tokens_are_skipped(tiny, window):
    tok = DecodeOnly(tiny) if window else tiny
    rng = random.Random(1)
    specials = tiny.all_special_ids
    assert streamed(tok, specials)[-1] == ""
    for _ in range(100):
        ids = with_specials(rng, tiny.encode(random_text(rng), add_special_tokens=False), specials)
        final = check_stream(tok, ids)
        assert not any(tiny.convert_ids_to_tokens(s) in final for s in specials)
    ids = tiny.encode("x", add_special_tokens=True)  # llama: BOS first
    assert streamed(tok, ids)[-1] == "x"


@pytest.mark.parametrize("window", [False, True], ids=["decode_stream", "window"])
def test_random_ids(tiny, window):
    """Any ids at all (invalid UTF-8 included): no error, and the same checks."""
    tok = DecodeOnly(tiny) if window else tiny
    rng = random.Random(2)
    byte_tokens = tiny.convert_ids_to_tokens(list(range(256)))  # GPT-2's byte table: ids 0-255
    high_bytes = [tiny.convert_tokens_to_ids(t) for t in byte_tokens if ord(t) > 0xA0]  # mostly >= 0x80
    for _ in range(300):
        pool = high_bytes if rng.random() < 0.5 else range(len(tiny))
        check_stream(tok, [rng.choice(pool) for _ in range(rng.randrange(1, 16))])


@pytest.mark.parametrize("window", [False, True], ids=["decode_stream", "window"])
def test_byte_fallback_tokens(byte_fallback, window):
    tok = DecodeOnly(byte_fallback) if window else byte_fallback
    specials = [byte_fallback.token_to_id("<s>"), byte_fallback.token_to_id("</s>")]
    assert byte_fallback.encode("中").tokens == ["▁", "<0xE4>", "<0xB8>", "<0xAD>"]
    rng = random.Random(4)
    for _ in range(150):
        text = random_text(rng).lstrip(" ")  # the decoder strips one leading space
        ids = with_specials(rng, byte_fallback.encode(text).ids, specials)
        assert check_stream(tok, ids) == text


def test_tokenizer_without_fast_backend(byt5):
    rng = random.Random(3)
    for _ in range(150):
        text = random_text(rng)
        ids = with_specials(rng, byt5.encode(text, add_special_tokens=False), byt5.all_special_ids)
        assert check_stream(byt5, ids) == text
    ids = byt5.encode("é中😀", add_special_tokens=False)
    assert streamed(byt5, ids) == ["", "é", "é", "é", "é中", "é中", "é中", "é中", "é中😀"]


def test_decoder_that_is_not_prefix_stable():
    """tokenizers' DecodeStream raises "Invalid prefix" here; the stream restarts and goes on."""

    class Reverse:
        def decode_chain(self, tokens: list[str]) -> list[str]:
            return ["".join(tokens)[::-1]]

    tok = Tokenizer(WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Decoder.custom(Reverse())
    texts = streamed(tok, [0, 1, 2, 0])
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and len(texts[-1]) == 4


def test_output_streams_the_final_text(tiny):
    chunks: list[str] = []
    ids = tiny.encode("Hi 😀 中文 done", add_special_tokens=False)
    out = Output(tiny, max_new_tokens=100, stops=["done"], eos=frozenset(), on_text=chunks.append)
    reason = None
    for n in range(1, len(ids) + 1):
        reason = out.accept(ids[:n])
        if reason:
            break
    assert reason == "stop"
    assert "".join(chunks) == out.final_text(ids[:n], reason) == "Hi 😀 中文 "
