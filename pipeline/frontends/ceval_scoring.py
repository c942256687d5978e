"""C-Eval style multiple choice: read the CSVs, pick each answer from one prefill's letter logits.

Why one forward per question: the answer is the choice letter the model finds most likely as
its next token, so no decoding is needed, and the result is deterministic (ties go to the
earlier letter). The instruction (and few-shot examples) are rendered by the model's own chat
template as the first messages of every prompt, so they form a real token prefix that the
shared ``KVCache`` keeps from one question to the next (``Prefill`` reuses it).

Python use::

    from pipeline import Pipeline, load_model
    from pipeline.frontends.ceval_scoring import Question, choose
    from stages import Prefill, Tokenize

    lm = load_model("Qwen/Qwen3-0.6B")
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill()})
    letter, logits = choose(pipe, Question("1 + 1 = ?", ("1", "2", "3", "4")))
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.context import Context, Request
from pipeline.errors import UserError, whole_number
from pipeline.kv import KVCache
from pipeline.pipeline import Pipeline

LETTERS: tuple[str, ...] = ("A", "B", "C", "D")
REQUIRED_COLUMNS: tuple[str, ...] = ("id", "question", "A", "B", "C", "D")
OPTIONAL_COLUMNS: tuple[str, ...] = ("answer", "explanation")  # C-Eval dev files carry explanations
SPLIT_SUFFIXES: tuple[str, ...] = ("_val", "_dev", "_test")
DEFAULT_INSTRUCTION = (
    "以下是中国关于{subject}考试的单项选择题，请选出其中的正确答案。只需回答选项字母（A、B、C 或 D）。"
)

# A few-shot source: one list for every subject, or one list per subject name.
DevSet = Sequence["Question"] | Mapping[str, Sequence["Question"]]


@dataclass(frozen=True)
class Question:
    """One multiple choice question; ``answer`` is None when the file gives none (a test split)."""

    question: str
    choices: tuple[str, str, str, str]
    answer: str | None = None
    id: str = ""
    subject: str = ""
    where: str = ""  # "file row N", for messages about this question


@dataclass
class Prediction:
    """The chosen letter, the four letter scores and what prefill had to compute for it."""

    question: Question
    letter: str
    logits: list[float]
    prompt_tokens: int
    prefill_tokens: int
    kv_reused_tokens: int
    seconds: float

    @property
    def correct(self) -> bool | None:
        return None if self.question.answer is None else self.letter == self.question.answer


# --- reading -----------------------------------------------------------------------------------


def subject_of(path: str | Path) -> str:
    """``computer_network_val.csv`` -> ``computer_network`` (the C-Eval split suffix is dropped)."""
    stem = Path(path).stem
    for suffix in SPLIT_SUFFIXES:
        if stem.endswith(suffix) and len(stem) > len(suffix):
            return stem[: -len(suffix)]
    return stem


def _column_name(raw: str) -> str:
    name = raw.strip()
    return name.upper() if len(name) == 1 else name.lower()


def read_csv(path: str | Path, subject: str | None = None, *, need_answers: bool = False) -> list[Question]:
    """Parse one C-Eval CSV (header ``id,question,A,B,C,D[,answer[,explanation]]``), checking every row.

    Any problem is a UserError naming the file and the row (data rows count from 1, the header
    not included; the line number is given too because quoted fields may span lines).
    """
    path = Path(path)
    subject = subject if subject is not None else subject_of(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or not any(cell.strip() for cell in header):
                raise UserError(f"{path}: empty file, expected a header row id,question,A,B,C,D[,answer]")
            names = [_column_name(c) for c in header]
            for name in names:
                if name not in REQUIRED_COLUMNS + OPTIONAL_COLUMNS:
                    raise UserError(
                        f"{path}: unexpected column {name!r} in the header (expected id,question,A,B,C,D[,answer])"
                    )
            for name in REQUIRED_COLUMNS:
                if name not in names:
                    raise UserError(
                        f"{path}: the header has no {name!r} column (expected id,question,A,B,C,D[,answer])"
                    )
            duplicated = sorted({n for n in names if names.count(n) > 1})
            if duplicated:
                raise UserError(f"{path}: column {duplicated[0]!r} appears twice in the header")
            if need_answers and "answer" not in names:
                raise UserError(f"{path}: few-shot examples need an 'answer' column")
            index = {name: i for i, name in enumerate(names)}
            has_answer = "answer" in index
            questions: list[Question] = []
            seen: dict[str, int] = {}
            row_no = 0
            for fields in reader:
                if not fields or (len(fields) == 1 and not fields[0].strip()):
                    continue  # blank line
                row_no += 1
                where = f"{path} row {row_no} (line {reader.line_num})"
                if len(fields) != len(names):
                    raise UserError(f"{where}: expected {len(names)} fields ({','.join(names)}), got {len(fields)}")
                qid = fields[index["id"]].strip()
                if not qid:
                    raise UserError(f"{where}: empty id")
                if qid in seen:
                    raise UserError(f"{where}: duplicate id {qid!r} (first used in row {seen[qid]})")
                seen[qid] = row_no
                text = fields[index["question"]].strip()
                if not text:
                    raise UserError(f"{where}: empty question")
                answer = None
                if has_answer:
                    answer = fields[index["answer"]].strip().upper()
                    if answer not in LETTERS:
                        raise UserError(f"{where}: answer {fields[index['answer']].strip()!r} is not one of A, B, C, D")
                choices = tuple(fields[index[letter]].strip() for letter in LETTERS)
                questions.append(Question(text, choices, answer, qid, subject, f"{path} row {row_no}"))  # type: ignore[arg-type]
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as err:  # a folder, no permission, ...
        raise UserError(f"{path}: cannot read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except csv.Error as err:
        raise UserError(f"{path} line {reader.line_num}: malformed CSV ({err})") from None
    if not questions:
        raise UserError(f"{path}: no questions after the header row")
    return questions


def csv_files(path: str | Path) -> list[Path]:
    """The CSV a path names, or the CSVs directly inside a folder, sorted; one per subject."""
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UserError(f"{path}: no such file or folder")
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".csv" and p.is_file())
    if not files:
        raise UserError(f"{path}: the folder holds no .csv files")
    by_subject: dict[str, Path] = {}
    for f in files:
        other = by_subject.setdefault(subject_of(f), f)
        if other != f:
            raise UserError(f"{path}: {other.name} and {f.name} are both subject {subject_of(f)!r}")
    return files


def load_questions(path: str | Path) -> list[Question]:
    """All questions of a CSV file, or of every subject file in a folder (grouped by subject)."""
    return [q for f in csv_files(path) for q in read_csv(f)]


def load_dev(path: str | Path) -> DevSet:
    """Few-shot examples: a file gives one list for every subject, a folder one list per subject."""
    path = Path(path).expanduser()
    if path.is_file():
        return read_csv(path, need_answers=True)
    return {subject_of(f): read_csv(f, need_answers=True) for f in csv_files(path)}


def shots_for(dev: DevSet | None, subject: str, shots: int) -> list[Question]:
    """The first ``shots`` dev examples of a subject (none without a dev set)."""
    if dev is None or shots <= 0:
        return []
    if isinstance(dev, Mapping):
        if subject not in dev:
            raise UserError(f"the dev set has no examples for subject {subject!r}")
        return list(dev[subject][:shots])
    return list(dev[:shots])


# --- prompting and scoring --------------------------------------------------------------------


def question_text(q: Question) -> str:
    """The question and its four options, one per line."""
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices))
    return f"{q.question}\n{options}"


def build_messages(q: Question, shots: Sequence[Question] = (), instruction: str = DEFAULT_INSTRUCTION) -> list[dict]:
    """System instruction, then each example as a user/assistant turn, then the question.

    Everything before the question's own user turn is identical for every question of a
    subject, so the rendered template gives the same leading tokens (the reusable prefix).
    """
    subject = (q.subject or "general").replace("_", " ")
    messages = [{"role": "system", "content": instruction.replace("{subject}", subject)}]
    for shot in shots:
        messages.append({"role": "user", "content": question_text(shot)})
        messages.append({"role": "assistant", "content": shot.answer or ""})
    messages.append({"role": "user", "content": question_text(q)})
    return messages


def make_request(
    q: Question, shots: Sequence[Question] = (), instruction: str = DEFAULT_INSTRUCTION, thinking: bool | None = False
) -> Request:
    """The request whose rendered prompt ends where the answer letter should come next."""
    return Request(messages=build_messages(q, shots, instruction), thinking=thinking, max_new_tokens=1, id=q.id)


def letter_token_ids(tokenizer: Any) -> list[list[int]]:
    """For each of A-D, the single tokens that spell it ("A", and " A" where that is one token).

    Why several: after a template's generation prompt one tokenizer predicts "A", another "▁A".
    A letter's score is the log-sum-exp of its tokens' logits (its total probability).
    """
    out: list[list[int]] = []
    for letter in LETTERS:
        ids: list[int] = []
        for variant in (letter, " " + letter):
            enc = tokenizer.encode(variant, add_special_tokens=False)
            if len(enc) == 1 and enc[0] not in ids and tokenizer.decode(enc).strip() == letter:
                ids.append(int(enc[0]))
        if not ids:
            raise UserError(f"the tokenizer has no single token for the choice letter {letter!r}")
        out.append(ids)
    flat = [t for ids in out for t in ids]
    if len(flat) != len(set(flat)):
        raise UserError("the tokenizer maps two choice letters to the same token: cannot tell A-D apart")
    return out


def letter_scores(logits: torch.Tensor, letter_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """[4] float32 scores on the CPU from next-token logits [1, V] or [V]."""
    row = logits.reshape(-1, logits.shape[-1])[0].float()
    return torch.stack([torch.logsumexp(row[list(ids)], dim=0) for ids in letter_ids]).cpu()


def scoring_pipeline(pipe: Pipeline) -> Pipeline:
    """The same pipeline cut after prefill (same model, pool and engine): one prefill per question, no decoding."""
    names = list(pipe.stages)
    if "prefill" not in names:
        raise ValueError("the pipeline has no 'prefill' stage to score with")
    keep = names[: names.index("prefill") + 1]
    return pipe.with_stages({name: pipe.stages[name] for name in keep})


def _score(
    pipe: Pipeline,
    q: Question,
    shots: Sequence[Question],
    instruction: str,
    thinking: bool | None,
    cache: KVCache,
    letter_ids: Sequence[Sequence[int]],
) -> tuple[Context, torch.Tensor]:
    ctx = pipe.run_context(make_request(q, shots, instruction, thinking), cache=cache)
    return ctx, letter_scores(ctx.logits, letter_ids)


def choose(
    pipe: Pipeline,
    question: Question,
    *,
    shots: Sequence[Question] = (),
    instruction: str = DEFAULT_INSTRUCTION,
    thinking: bool | None = False,
    cache: KVCache | None = None,
) -> tuple[str, torch.Tensor]:
    """(letter, scores[4]) for one question. Pass the same ``cache`` on to reuse the shared prefix."""
    scorer = scoring_pipeline(pipe)
    cache = cache if cache is not None else pipe.new_cache()
    _, scores = _score(scorer, question, shots, instruction, thinking, cache, letter_token_ids(pipe.lm.tokenizer))
    return LETTERS[int(scores.argmax())], scores


def evaluate(
    pipe: Pipeline,
    questions: Sequence[Question],
    *,
    dev: DevSet | None = None,
    shots: int = 5,
    instruction: str = DEFAULT_INSTRUCTION,
    thinking: bool | None = False,
    cache: KVCache | None = None,
    on_prediction: Callable[[Prediction], None] | None = None,
) -> list[Prediction]:
    """Answer every question; returns predictions in input order (``on_prediction`` sees them as they end).

    Without ``cache``: per subject, the first question runs alone, which leaves the instruction
    and few-shot prefix in the prefix cache; the others are then prefilled concurrently by the
    engine, each computing only its own suffix. With ``cache``: one question after another on it.
    """
    whole_number("ceval.shots", shots, 0)
    scorer = scoring_pipeline(pipe)
    letter_ids = letter_token_ids(pipe.lm.tokenizer)

    def predict(q: Question, ctx: Context) -> Prediction:
        scores = letter_scores(ctx.logits, letter_ids)
        m = ctx.metrics.to_dict()
        pred = Prediction(
            question=q,
            letter=LETTERS[int(scores.argmax())],
            logits=scores.tolist(),
            prompt_tokens=m["prompt_tokens"],
            prefill_tokens=m["prefill_tokens"],
            kv_reused_tokens=m["kv_reused_tokens"],
            seconds=m["total_s"] or 0.0,
        )
        if on_prediction is not None:
            on_prediction(pred)
        return pred

    def request(q: Question):
        return make_request(q, shots_for(dev, q.subject, shots), instruction, thinking)

    if cache is not None:
        return [predict(q, scorer.run_context(request(q), cache=cache)) for q in questions]
    out: list[Prediction | None] = [None] * len(questions)
    by_subject: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_subject.setdefault(q.subject, []).append(i)
    for indices in by_subject.values():
        first, rest = indices[0], indices[1:]
        ctx = scorer.run_context(request(questions[first]))
        out[first] = predict(questions[first], ctx)
        ctx.cache.clear()  # its full blocks stay in the prefix cache for the others
        for i, ctx in scorer.run_many(((i, request(questions[i])) for i in rest), result=False):
            if isinstance(ctx, BaseException):
                raise ctx
            out[i] = predict(questions[i], ctx)
            ctx.cache.clear()
    return out  # type: ignore[return-value]


def _score_counts(preds: Sequence[Prediction]) -> dict:
    correct = sum(1 for p in preds if p.correct)
    return {"accuracy": correct / len(preds), "correct": correct, "total": len(preds)}


def summarize(predictions: Sequence[Prediction]) -> dict | None:
    """Accuracy overall and per subject over the questions that have answers (None if none do)."""
    graded = [p for p in predictions if p.question.answer is not None]
    if not graded:
        return None
    subjects: dict[str, list[Prediction]] = {}
    for p in graded:
        subjects.setdefault(p.question.subject, []).append(p)
    out = _score_counts(graded)
    out["subjects"] = {name: _score_counts(preds) for name, preds in subjects.items()}
    return out


def answers_rows(predictions: Sequence[Prediction], with_subject: bool) -> list[list[str]]:
    """answers.csv: ``id,answer``, or ``subject,id,answer`` when several subjects share the file."""
    header = ["subject", "id", "answer"] if with_subject else ["id", "answer"]
    rows = [header]
    for p in predictions:
        row = [p.question.id, p.letter]
        rows.append([p.question.subject, *row] if with_subject else row)
    return rows
