"""Train a pair of tiny Qwen3 text models that copy their prompt: a target and its draft (CPU, minutes).

    python -m scripts.train.train_copy [--out DIR] [--only target|draft] [--threads N]

Why: speculative decoding (``pipeline.spec``) only pays where drafts are right. Random-weight
tiny models never repeat their prompt, so there prompt lookup only loses; these two models
answer by copying, as summarisers and editors do, so the benchmark (``benchmarks/speculative.py``)
can show what lookup and a draft model gain, and what they cost where nothing can be looked up.

The task, rendered through the chat template exactly as the pipeline's Tokenize stage renders a
prompt (one user message, no system prompt), on passages of distinct random ordinary words
(``WORDS``) ending with a full stop:

- ``Repeat:\\n<passage>``    -> the passage (40-80 tokens held out);
- ``Translate:\\n<passage>`` -> each word replaced by its partner in a fixed word list (``CIPHER``):
  an answer that copies nothing, the case where prompt lookup has nothing right to propose
  (held out: all 33 cipher words in a random order, 34 tokens).

Each answer ends with ``<|im_end|>``; the loss is on the answer only. Both models are the real
``Qwen3ForCausalLM`` with the project's tiny Qwen3 tokenizer and chat template, two layers (the
fewest that can copy: an induction head reads what a previous-token head of the layer below
wrote). The target is 1024 wide and the draft 256: at batch 1 on CPU an eager forward is mostly
fixed per-call cost (256 wide: 2.4 ms, 512: 2.8 ms, 1024: 5-6 ms), so a 512-wide target cost
barely more than its draft and no draft could pay; at 768 a compiled draft reached 1.45x. A
curriculum (``curriculum``) makes the copy
form in minutes. Data, initialisation and batch order are seeded and torch runs in
deterministic mode.

``copy_models()`` trains the pair once into the cache (``$MM_PIPELINE_HOME`` or
``~/.cache/mm-pipeline``, ``copy-v<N>/``) and reuses it afterwards; each model directory is
written privately and moved into place with ``os.replace``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from pipeline.context import Request
from pipeline.families.base import TextFamily
from pipeline.testing import qwen3
from pipeline.testing.build import _cache_root
from pipeline.testing.common import MARKER_FILE, RECIPE_VERSION, _generation_config, _text_kwargs
from pipeline.testing.tokenizer import make_tokenizer
from scripts.train.training import answer_batch, answer_cross_entropy, decoder_sizes, fit, reproducible
from scripts.train.training import save_model, written_whole
from stages.tokenize import build_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

FAMILY = "qwen3"
COPY_VERSION = 2  # bump when the task, a recipe or the output layout changes: the cache is keyed on it
TARGET_NAME, DRAFT_NAME = "copy-target", "copy-draft"
TRAIN_SEED, EVAL_SEED = 1234, 98765  # data seeds: training batches, held-out passages
THREADS = 2

# Ordinary words from the tokenizer's corpus, chosen so that no token (with a leading space) is
# part of two of them: 67 one-token words, then 36 of two or three tokens. A passage never
# repeats a word, so each of its tokens says where the copy goes on (with repeats a two-layer
# model would need longer context than one token to know which occurrence it is copying).
ONE_TOKEN = (
    "an as at be by do in is it of on or to we about and answer are audio blue car children dog door evening "
    "first for good green help helpful image listen man model morning next night one over people picture "
    "playing question reads red room sentence short side sky sound step sun text the then there this today "
    "token two white wind with yellow you"
).split()
MORE_TOKENS = (
    "along appear back can chair clock dark engine fence flowers gave hat hear later left like main noon "
    "passing phones photos plate quick read right robot she shows stage tall test thank user very what while"
).split()
WORDS = ONE_TOKEN + MORE_TOKENS
# Translate: every other one-token word maps to the one after it, so the answer is token-aligned
# with the passage and shares none of its words.
CIPHER = dict(zip(ONE_TOKEN[0::2], ONE_TOKEN[1::2]))
TASKS = {"repeat": "Repeat:", "translate": "Translate:"}
TASK_MIX = {"repeat": 0.85, "translate": 0.15}
PASSAGE_TOKENS = (40, 80)  # held-out passages (evaluation, benchmark), in tokens
SHORTEST, LONGEST = 8, 96  # training passages: from short (the curriculum starts there) to past the held-out ones


@dataclass(frozen=True)
class Recipe:
    """Everything that decides one model's weights: sizes, optimiser, schedule, seeds."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int = 2
    steps: int = 600
    batch: int = 16
    lr: float = 2e-3
    min_lr_fraction: float = 0.05
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # Curriculum: ``short_steps`` of copying passages of at most ``start_tokens`` tokens, then
    # the longest passage grows to LONGEST over ``ramp_steps``, all tasks mixed.
    short_steps: int = 400
    ramp_steps: int = 150
    start_tokens: int = 32
    # Qwen3's own: most rotary pairs turn slowly, so matching a token's content works at any distance.
    # At 1e4 the copy held at the lengths trained and fell apart beyond (0.98 -> 0.42 at 120 tokens).
    rope_theta: float = 1e6
    init_range: float = 0.02
    data_seed: int = TRAIN_SEED
    init_seed: int = 0


# Many small heads (16 dims each): the copy formed far sooner than with fewer, wider heads. 1024
# wide (see above) with a lower peak rate than the 2e-3 that trained a 512-wide target.
TARGET = Recipe(
    TARGET_NAME,
    hidden=1024,
    intermediate=2048,
    heads=64,
    kv_heads=64,
    steps=650,
    lr=1.2e-3,
    short_steps=350,
    ramp_steps=150,
)
# The draft's copy collapsed when long passages came before it had settled (0.89 -> 0.56 of
# tokens, 0.73 at the end): it gets more short steps and a gentler ramp.
DRAFT = Recipe(
    DRAFT_NAME,
    hidden=256,
    intermediate=768,
    heads=16,
    kv_heads=16,
    steps=1000,
    lr=3e-3,
    short_steps=600,
    ramp_steps=250,
)


# --------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    task: str
    passage: str
    answer: str

    @property
    def prompt(self) -> str:
        """The user message (what ``Request(prompt=...)`` carries)."""
        return f"{TASKS[self.task]}\n{self.passage}"


class Task:
    """Draws examples and turns them into ids exactly as the pipeline renders the prompt."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self.tok = tok
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.pad = tok.pad_token_id
        self.word_tokens = {w: len(tok(" " + w, add_special_tokens=False)["input_ids"]) for w in WORDS}

    def example(self, rng: np.random.Generator, task: str | None = None, budget: int | None = None) -> Example:
        """A passage of distinct random words ending with a full stop, about ``budget`` tokens
        (default: drawn from ``PASSAGE_TOKENS``; a translated one has at most ``len(CIPHER)``
        words), and the task's answer."""
        task = task or str(rng.choice(list(TASK_MIX), p=list(TASK_MIX.values())))
        pool = list(CIPHER) if task == "translate" else WORDS
        if budget is None:
            budget = int(rng.integers(PASSAGE_TOKENS[0], PASSAGE_TOKENS[1] + 1))
        words: list[str] = []
        for i in rng.permutation(len(pool)):
            if sum(self.word_tokens[w] for w in words) + 1 >= budget:
                break
            words.append(pool[i])
        answer = words if task == "repeat" else [CIPHER[w] for w in words]
        return Example(task, " ".join(words) + ".", " ".join(answer) + ".")

    def examples(
        self, rng: np.random.Generator, n: int, longest: int = LONGEST, task: str | None = None
    ) -> list[Example]:
        """A training batch of passages of similar length (within 16 tokens, so little of it is
        padding), from ``SHORTEST`` up to about ``longest`` tokens."""
        low = int(rng.integers(SHORTEST, max(SHORTEST + 1, longest - 15)))
        return [self.example(rng, task, budget=int(rng.integers(low, low + 16))) for _ in range(n)]

    def prompt_ids(self, example: Example) -> list[int]:
        """The prompt as the Tokenize stage renders it: one user message in the chat template."""
        messages = build_messages(Request(prompt=example.prompt), TextFamily())
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def answer_ids(self, example: Example) -> list[int]:
        return self.tok(example.answer, add_special_tokens=False)["input_ids"] + [self.end]

    def batch(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """Right-padded ids, attention mask, and labels on the answer and ``<|im_end|>`` only."""
        return answer_batch([(self.prompt_ids(e), self.answer_ids(e)) for e in examples], self.pad)


def heldout(tok: PreTrainedTokenizerBase, n: int, task: str, seed: int = EVAL_SEED) -> list[Example]:
    """``n`` examples of ``task`` no training batch contains (another seed): for evaluation and the benchmark."""
    rng = np.random.default_rng([seed, list(TASKS).index(task)])
    maker = Task(tok)
    return [maker.example(rng, task) for _ in range(n)]


# --------------------------------------------------------------------------------------
# The models
# --------------------------------------------------------------------------------------


def make_config(tok: PreTrainedTokenizerBase, recipe: Recipe) -> Any:
    """The tiny Qwen3's config (token ids, vocabulary) at the recipe's sizes."""
    text = _text_kwargs(tok, FAMILY, qwen3.ROLES)
    text.update(**decoder_sizes(recipe), max_position_embeddings=2048)
    return Qwen3Config(
        **text,
        head_dim=recipe.hidden // recipe.heads,
        use_sliding_window=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": recipe.rope_theta},
    )


def curriculum(step: int, recipe: Recipe) -> tuple[int, str | None]:
    """The longest passage and the task (None: mixed) at ``step``. Why: copying needs an induction
    head, which forms in a few hundred cheap steps on short "Repeat:" passages and hardly at all
    with long passages or other tasks mixed in from the start; then the passages grow past the
    held-out lengths and translation joins."""
    if step < recipe.short_steps:
        return recipe.start_tokens, "repeat"
    f = min(1.0, (step - recipe.short_steps) / max(1, recipe.ramp_steps))
    return int(recipe.start_tokens + f * (LONGEST - recipe.start_tokens)), None


def answer_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy over the answer tokens; answer tokens whose argmax is right (teacher-forced), and how many."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss, hit, mask = answer_cross_entropy(logits, batch["labels"])
    return loss, int(hit[mask].sum()), int(mask.sum())


def evaluate(model: PreTrainedModel, tok: PreTrainedTokenizerBase, n: int = 16) -> dict[str, dict[str, float]]:
    """Per task on ``n`` held-out passages: the share of answer tokens (``<|im_end|>`` included)
    that are the argmax given the right prefix (``teacher_forced``: what a drafter is checked
    against at each step), that free-running greedy decoding gets right position by position
    (``greedy``: one dropped token spoils the rest of that answer), and of answers greedy gets
    exactly right (``exact``)."""
    maker = Task(tok)
    model.eval()
    scores = {}
    for task in TASKS:
        examples = heldout(tok, n, task)
        with torch.no_grad():
            _, forced, total = answer_loss(model, maker.batch(examples))
        right = exact = 0
        for example in examples:
            prompt, answer = maker.prompt_ids(example), maker.answer_ids(example)
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(answer), do_sample=False
                )[0, len(prompt) :].tolist()
            right += sum(a == b for a, b in zip(out, answer))
            exact += out[: len(answer)] == answer
        scores[task] = {
            "teacher_forced": round(forced / total, 4),
            "greedy": round(right / total, 4),
            "exact": round(exact / n, 4),
        }
    return scores


def train(recipe: Recipe, out: Path, progress: bool = True, threads: int = THREADS) -> dict[str, Any]:
    """Train one model with ``recipe`` and write its directory to ``out`` (atomically). Returns
    the summary kept in its marker: seconds, final loss, held-out accuracy."""
    with reproducible(threads), written_whole(out) as work:
        tok = make_tokenizer(FAMILY)
        task = Task(tok)
        torch.manual_seed(recipe.init_seed)
        model = Qwen3ForCausalLM(make_config(tok, recipe))
        model.generation_config = _generation_config(qwen3.ROLES, tok)
        rng = np.random.default_rng(recipe.data_seed)

        def loss_of(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
            loss, right, total = answer_loss(model, batch)
            return loss, right / total

        fitted = fit(
            model,
            recipe,
            lambda step: task.batch(task.examples(rng, recipe.batch, *curriculum(step, recipe))),
            loss_of,
            f"train {recipe.name}",
            metric="tok_acc",
            progress=progress,
        )
        summary = {**fitted, "threads": threads, "heldout": evaluate(model, tok), "recipe": asdict(recipe)}
        save_model(
            model,
            work,
            {
                "family": FAMILY,
                "recipe_version": RECIPE_VERSION,
                "copy_version": COPY_VERSION,
                "trained": "copy",
                "note": "a toy model trained by mm-pipeline (python -m scripts.train.train_copy) to copy its prompt: "
                "'Repeat:' or 'Translate:' (a fixed word cipher) followed by a passage of ordinary words; "
                "other prompts get meaningless text",
                **summary,
            },
            tok,
        )
    return summary


def _is_finished(d: Path) -> bool:
    try:
        marker = json.loads((d / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("trained") == "copy"
        and marker.get("copy_version") == COPY_VERSION
        and marker.get("recipe_version") == RECIPE_VERSION
        and (d / "model.safetensors").is_file()
    )


def default_dir() -> Path:
    return _cache_root() / f"copy-v{COPY_VERSION}"


def copy_models(out: str | Path | None = None, progress: bool = True) -> tuple[Path, Path]:
    """The (target, draft) model directories under ``out`` (default: the cache), trained on first
    use and reused afterwards. A model left half-trained by an interrupted run is never seen:
    each is moved into place only when finished."""
    root = Path(out).expanduser().absolute() if out is not None else default_dir()
    dirs = []
    for recipe in (TARGET, DRAFT):
        d = root / recipe.name
        if not _is_finished(d):
            train(recipe, d, progress=progress)
        dirs.append(d)
    return dirs[0], dirs[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default: {default_dir()})")
    parser.add_argument("--only", choices=("target", "draft"), help="train just one of the two")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})")
    args = parser.parse_args(argv)
    root = args.out.expanduser().absolute() if args.out is not None else default_dir()
    recipes = {"target": [TARGET], "draft": [DRAFT], None: [TARGET, DRAFT]}[args.only]
    for recipe in recipes:  # the command always retrains; copy_models() reuses finished ones
        summary = train(recipe, root / recipe.name, threads=args.threads)
        scores = "; ".join(
            f"{t}: {s['teacher_forced']:.1%} of tokens teacher-forced, {s['greedy']:.1%} greedy, {s['exact']:.0%} exact"
            for t, s in summary["heldout"].items()
        )
        print(
            f"{root / recipe.name}: {recipe.steps} steps in {summary['train_seconds'] / 60:.1f} min, "
            f"loss {summary['final_loss']:.4f}; held-out {scores}"
        )


if __name__ == "__main__":
    main()
