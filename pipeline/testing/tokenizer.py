"""The project's own byte-level BPE tokenizer builder (``make_tokenizer``).

Why: real tokenizers cannot be downloaded here.  This one is trained deterministically on a
small embedded corpus and given the published pre-tokenizer, special tokens (at fixed ids, in
the published order) and chat template, so prompts render the way the real ones do.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

from pipeline.testing.common import NUM_MERGES
from pipeline.testing.registry import CHAT_TEMPLATES, family_module

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Pre-tokenizer split patterns of the real tokenizers.
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Small English corpus the BPE merges are learned from: ordinary words become a few tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe this image in one sentence. What is in the picture? What do you hear in this sound?
The image shows a red car parked on the street next to a small green house with a white door.
There is a cat sitting on the table and a dog sleeping under the chair in the living room.
Please answer the question with a short and clear sentence. Think step by step before you answer.
The weather today is sunny and warm, with a light wind from the west and a few clouds in the sky.
In the morning the children walk to school, and in the evening they come back home for dinner.
This audio clip contains the sound of a bird singing, a car passing by, and people talking.
The woman is holding a blue umbrella while she waits for the bus at the corner of the road.
A man is playing the guitar on the stage, and the people in the room are listening to the music.
The model reads the text, looks at the image, listens to the audio, and then writes an answer.
Hello! How are you today? I am fine, thank you. What would you like to know about this photo?
The answer is yes. The answer is no. There are three apples, two oranges and one banana on the plate.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in the text, along with dates and times.
You are a helpful assistant. The user asked a question, and the assistant gave a helpful answer.
Here is a summary of the main points: first, the system loads the model; second, it reads the input;
third, it encodes the image and the audio; fourth, it generates the answer one token at a time.
The river flows through the valley between the mountains, and the trees on the hills are green.
She opened the window, looked at the garden, and saw that the flowers were red, yellow and purple.
We can see a large building with many windows, a tall tower, and a bridge over the water.
The train leaves the station at nine o'clock and arrives in the city two hours later.
It's a beautiful day, isn't it? They're going to the park, and we'll meet them there at noon.
Look at the left side of the picture: there is a person wearing a black jacket and a white hat.
On the right side, two children are playing with a ball near the fence, and a dog is running.
The sound is loud at first and then becomes quiet; it could be a door closing or a car engine.
Write a short story about a robot who learns to paint pictures of the sea and the sky.
The first step is to read the question carefully. The next step is to find the important details.
This is a simple test of the tokenizer, the chat template, the processor and the language model.
Good morning, good afternoon, good evening and good night. Thank you very much for your help.
The color of the sky is blue, the grass is green, the sun is yellow, and the night is dark.
People often use computers, phones and cameras to take photos, record videos and listen to songs.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel pre-tokenizers produce)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _backend_pipeline(family: str) -> tuple[Any, Any, Any]:
    """Normalizer / pre-tokenizer / decoder of the family's real tokenizer.json."""
    split = _LLAMA3_SPLIT if family == "llama" else _QWEN_SPLIT
    normalizer = None if family == "llama" else normalizers.NFC()
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=family == "llama", use_regex=False),
        ]
    )
    return normalizer, pre, decoders.ByteLevel()


def _train_bpe(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Deterministic BPE: most frequent pair first, ties broken by the pair itself."""
    seqs = [list(w) for w in sorted(words)]
    counts = [words[w] for w in sorted(words)]
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, s in enumerate(seqs):
        for p in zip(s, s[1:]):
            pair_counts[p] += counts[i]
            where[p].add(i)
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges and pair_counts:
        best = min(pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        a, b = pair = best[0]
        merges.append(pair)
        for i in sorted(where.pop(pair, ())):
            s, c = seqs[i], counts[i]
            for p in zip(s, s[1:]):
                pair_counts[p] -= c
                if pair_counts[p] <= 0:
                    del pair_counts[p]
            out, j = [], 0
            while j < len(s):
                if j + 1 < len(s) and s[j] == a and s[j + 1] == b:
                    out.append(a + b)
                    j += 2
                else:
                    out.append(s[j])
                    j += 1
            seqs[i] = out
            for p in zip(out, out[1:]):
                pair_counts[p] += c
                where[p].add(i)
        pair_counts.pop(pair, None)
    return merges


@lru_cache(maxsize=None)
def _vocab_and_merges(family: str) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    normalizer, pre, _ = _backend_pipeline(family)
    words: Counter[str] = Counter()
    for line in _CORPUS.splitlines(keepends=True):
        text = normalizer.normalize_str(line) if normalizer is not None else line
        words.update(piece for piece, _ in pre.pre_tokenize_str(text))
    merges = _train_bpe(words, NUM_MERGES)
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode()[b] for b in range(256))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return tuple(vocab.items()), tuple(merges)


def make_tokenizer(family: str) -> PreTrainedTokenizerBase:
    """Byte-level BPE tokenizer with the family's special tokens and chat template.

    Why: real tokenizers cannot be downloaded here; this one has the same pre-tokenizer,
    special tokens and template as the published one, so prompts render the same way.
    Qwen families get ``Qwen2Tokenizer`` (what their hub configs name), llama and gemma3 get
    ``PreTrainedTokenizerFast`` with a BOS post-processor (both add BOS when tokenizing, as
    published); a module's ``NAMED_TOKENS`` become named special tokens (``tok.boi_token``).
    """
    family_module(family)  # an unknown name fails here, clearly
    vocab_items, merges = _vocab_and_merges(family)
    vocab, merges = dict(vocab_items), list(merges)
    roles = family_module(family).ROLES
    specials = family_module(family).SPECIAL_TOKENS
    # Special tokens get the ids right after the merges, in the published order, whatever
    # order the tokenizer class registers them in.
    for t, _ in specials:
        vocab[t] = len(vocab)
    added = [
        AddedToken(t, special=s, normalized=False, lstrip=False, rstrip=False, single_word=False) for t, s in specials
    ]

    if family in ("llama", "gemma3"):
        normalizer, pre, decoder = _backend_pipeline(family)
        backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.pre_tokenizer = pre
        backend.decoder = decoder
        backend.add_tokens(added)
        bos = roles["bos"]
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, bos_id)],
                ),
            ]
        )
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token=bos,
            eos_token=roles["eos"],
            pad_token=roles["pad"],
            model_max_length=131072,
            clean_up_tokenization_spaces=False,
            model_input_names=["input_ids", "attention_mask"],
            **getattr(family_module(family), "NAMED_TOKENS", {}),  # e.g. Gemma 3's boi_token, image_token
        )
    else:
        tok = Qwen2Tokenizer(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            bos_token=None,
            eos_token=roles["eos"],
            pad_token=roles["pad"],
            model_max_length=32768,
            errors="replace",
            split_special_tokens=False,
            clean_up_tokenization_spaces=False,
            **getattr(family_module(family), "NAMED_TOKENS", {}),  # e.g. Qwen2.5-Omni's image_token, audio_token
        )
        # Qwen2Tokenizer registers eos/pad itself; add the rest in the published order.
        tok.add_tokens(added)
    extra = [t for t, s in specials if s and t not in (roles["bos"], roles["eos"], roles["pad"])]
    tok.add_special_tokens({"additional_special_tokens": extra})  # saved as extra_special_tokens
    tok.chat_template = CHAT_TEMPLATES[family]
    _check_ids(tok, family)
    return tok


def _check_ids(tok: PreTrainedTokenizerBase, family: str) -> None:
    """Special tokens must stay single tokens at fixed ids, in the published order."""
    ids = [tok.convert_tokens_to_ids(t) for t, _ in family_module(family).SPECIAL_TOKENS]
    base = ids[0]
    if ids != list(range(base, base + len(ids))) or base != len(dict(_vocab_and_merges(family)[0])):
        raise RuntimeError(f"tiny {family} tokenizer: special token ids out of order: {ids}")
