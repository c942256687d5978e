"""Streaming detokenisation: TextStream against the old re-decode-everything method.

Why: the old ``TextStream.push`` decoded the whole answer again for every token, so streaming an
answer of n tokens cost O(n^2); the incremental one should cost O(n): streaming 4,000 tokens at
most about 4x what 1,000 cost.  Each method streams the same answer (a seeded mix of English,
accents, CJK and emoji, through the project's tiny tokenizer) one id at a time, reading ``.text``
after every push as ``Output`` does; best of ``--reps`` runs, methods alternating.  Rows:

- ``TextStream (DecodeStream)``: the tokenizer as the engine gets it (a ``tokenizers`` backend);
- ``TextStream (window)``: the same tokenizer seen through ``decode`` alone (the path taken by
  tokenizers without a fast backend);
- ``old: decode all``: the previous implementation, inlined below as the baseline.

The streamed text is checked against the full decode (its complete part); the script exits 1
if any differs.

    python benchmarks/detokenize.py                       # 1000 and 4000 tokens, tiny qwen3 tokenizer
    python benchmarks/detokenize.py --tokens 500,2000,8000 --reps 5 --family llama
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipeline.engine.output import TextStream  # noqa: E402

WORDS = (
    "the model reads the image and writes an answer , café naïve déjà vu 中文 字符 测试 漢字 かな "
    "한국어 😀 🎉 👍🏽 🇫🇷 Ωπ∑ 42 2024 ."
).split()


class OldTextStream:
    """The previous implementation (quadratic: the whole answer is decoded at every token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.text = text


class DecodeOnly:
    """The tokenizer seen through ``decode`` alone: TextStream takes its window path."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def answer_ids(tokenizer: Any, n: int, seed: int = 0) -> list[int]:
    """``n`` ids of a seeded pseudo-answer."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        text = " ".join(rng.choice(WORDS) for _ in range(200)) + "\n"
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def stream_seconds(make: Callable[[], Any], ids: list[int]) -> tuple[float, str]:
    """Seconds to push every id (reading ``.text`` after each, as ``Output`` does); the text."""
    start = time.perf_counter()
    stream = make()
    for i in ids:
        stream.push(i)
        _ = len(stream.text)
    return time.perf_counter() - start, stream.text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1000,4000", help="answer lengths, comma-separated (ratio: last/first)")
    ap.add_argument("--reps", type=int, default=3, help="runs per method and length; the best is kept")
    ap.add_argument("--family", default="qwen3", help="tiny tokenizer family (pipeline.testing)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]

    from pipeline.testing.tokenizer import make_tokenizer

    tok = make_tokenizer(args.family)
    methods: dict[str, Callable[[], Any]] = {
        "TextStream (DecodeStream)": lambda: TextStream(tok),
        "TextStream (window)": lambda: TextStream(DecodeOnly(tok)),
        "old: decode all": lambda: OldTextStream(tok),
    }
    best = {(m, n): float("inf") for m in methods for n in sizes}
    ok = True
    for n in sizes:
        ids = answer_ids(tok, n)
        expected = tok.decode(ids, skip_special_tokens=True)
        for _ in range(args.reps):
            for name, make in methods.items():  # alternating, so drift hits every method alike
                seconds, text = stream_seconds(make, ids)
                best[name, n] = min(best[name, n], seconds)
                # an answer cut inside a character streams all but that character
                ok &= text == expected or (expected.endswith("\ufffd") and expected.startswith(text))

    print(f"tiny {args.family} tokenizer, best of {args.reps}; seconds to stream an answer of n tokens")
    head = ["method"] + [f"n={n}" for n in sizes] + [f"ratio {sizes[-1]}/{sizes[0]}"]
    rows = [
        [m] + [f"{best[m, n]:.4f}" for n in sizes] + [f"{best[m, sizes[-1]] / best[m, sizes[0]]:.2f}x"] for m in methods
    ]
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print(f"streamed text == full decode: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
