"""mode=ceval: letters from one prefill, accuracy, prefix reuse, and one-line errors for bad CSVs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from conftest import run_cli
from pipeline import Pipeline, UserError
from pipeline.frontends import ceval_scoring as ceval
from pipeline.frontends.ceval_scoring import LETTERS, Question
from pipeline.modes.ceval import main as ceval_main
from stages import DecodeLoop, Prefill, Tokenize

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
HEADER = ["id", "question", "A", "B", "C", "D", "answer"]

QUESTIONS = [
    ("TCP 属于哪一层？", ("物理层", "传输层", "网络层", "应用层")),
    ("1 + 1 = ?", ("1", "2", "3", "4")),
    ("Which planet is red?", ("Venus", "Mars", "Jupiter", "Saturn")),
    ("HTTP 默认端口是多少？", ("21", "80", "443", "25")),
    ("The sea is mostly made of what?", ("sand", "salt water", "ice", "oil")),
    ("Which one is a prime number?", ("4", "6", "7", "9")),
]


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3", dtype="float32")  # exact comparisons with a plain forward, GPU included


@pytest.fixture(scope="module")
def pipe(lm):
    return Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill()})


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=["mode=ceval", "model.dtype=float32", *overrides])


def questions(subject: str, items=QUESTIONS) -> list[Question]:
    return [Question(text, choices, None, str(i), subject) for i, (text, choices) in enumerate(items)]


def oracle_scores(lm, q: Question, shots=()) -> torch.Tensor:
    """The four letter logits from one plain forward (no cache) over the template-rendered prompt."""
    messages = ceval.build_messages(q, shots)
    ids = lm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, return_dict=True, return_tensors="pt"
    )["input_ids"].to(lm.device)
    letter_ids = lm.tokenizer.convert_tokens_to_ids(list(LETTERS))
    with torch.inference_mode():
        logits = lm.model(input_ids=ids).logits[0, -1]
    return logits[letter_ids].float().cpu()


def oracle_letter(lm, q: Question, shots=()) -> str:
    return LETTERS[int(oracle_scores(lm, q, shots).argmax())]


def wrong(letter: str) -> str:
    return LETTERS[(LETTERS.index(letter) + 1) % 4]


def write_csv(path: Path, rows: list[list[str]], header: list[str] = HEADER) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def graded_rows(lm, qs: list[Question], right: list[bool]) -> list[list[str]]:
    rows = []
    for q, ok in zip(qs, right):
        expected = oracle_letter(lm, q)
        rows.append([q.id, q.question, *q.choices, expected if ok else wrong(expected)])
    return rows


def test_letter_tokens_are_single_tokens_of_each_letter(lm):
    ids = ceval.letter_token_ids(lm.tokenizer)
    assert len(ids) == 4
    for letter, group in zip(LETTERS, ids):
        assert group and all(lm.tokenizer.decode([t]).strip() == letter for t in group)


def test_indistinct_letters_are_refused():
    class SameToken:
        def encode(self, text, add_special_tokens=False):
            return [7]

        def decode(self, ids):
            return "A"

    with pytest.raises(UserError, match="choice letter"):
        ceval.letter_token_ids(SameToken())


def test_half_right_answers_give_accuracy_one_half(lm, pipe, tmp_path):
    qs = questions("computer_network")[:4]
    path = write_csv(tmp_path / "computer_network_val.csv", graded_rows(lm, qs, [True, False, True, False]))
    loaded = ceval.load_questions(path)
    assert [q.subject for q in loaded] == ["computer_network"] * 4
    preds = ceval.evaluate(pipe, loaded, shots=0)
    assert [p.letter for p in preds] == [oracle_letter(lm, q) for q in qs]
    for p, q in zip(preds, qs):  # reused-cache scores equal a plain full forward
        torch.testing.assert_close(torch.tensor(p.logits), oracle_scores(lm, q), atol=1e-4, rtol=1e-4)
    summary = ceval.summarize(preds)
    assert summary["accuracy"] == 0.5 and summary["correct"] == 2 and summary["total"] == 4
    assert summary["subjects"] == {"computer_network": {"accuracy": 0.5, "correct": 2, "total": 4}}


def test_shared_prefix_comes_from_the_prefix_cache_and_questions_batch(lm, pipe):
    dev = questions("physics", QUESTIONS[4:])
    dev = [Question(q.question, q.choices, "B", q.id, q.subject) for q in dev]
    qs = questions("physics", QUESTIONS[:4])
    rendered = [
        lm.tokenizer.apply_chat_template(
            ceval.build_messages(q, dev[:2]), add_generation_prompt=True, enable_thinking=False, return_dict=True
        )["input_ids"]
        for q in qs
    ]
    calls = []
    hook = lm.model.get_decoder().register_forward_hook(lambda *args: calls.append(1))  # the engine runs the decoder
    try:
        preds = ceval.evaluate(pipe, qs, dev=dev, shots=2)
    finally:
        hook.remove()
    assert 1 <= len(calls) < len(qs)  # the first alone, the other three in one step
    assert preds[0].kv_reused_tokens == 0
    block = pipe.pool.block_size
    for now, pred in zip(rendered[1:], preds[1:]):
        shared = next(i for i, (a, b) in enumerate(zip(rendered[0] + [None], now)) if a != b)
        assert pred.kv_reused_tokens == shared // block * block  # the common prefix, in whole blocks
        assert dev[1].question in lm.tokenizer.decode(now[: pred.kv_reused_tokens])  # it spans the few-shot turns
    assert all(p.prefill_tokens == p.prompt_tokens - p.kv_reused_tokens for p in preds)
    assert [p.letter for p in preds] == [oracle_letter(lm, q, dev) for q in qs]


def test_choose_cuts_a_full_pipeline_after_prefill(lm):
    full = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()})
    q = questions("math")[1]
    calls = []
    hook = lm.model.get_decoder().register_forward_hook(lambda *args: calls.append(1))  # the engine runs the decoder
    try:
        letter, scores = ceval.choose(full, q)
    finally:
        hook.remove()
    assert len(calls) == 1
    assert letter == oracle_letter(lm, q) and scores.shape == (4,)


def test_folder_mode_writes_answers_and_per_subject_accuracy(lm, tiny_dir, tmp_path, monkeypatch, capsys):
    data = tmp_path / "val"
    data.mkdir()
    alpha = questions("alpha", QUESTIONS[:2])
    beta = questions("beta", QUESTIONS[2:6])
    write_csv(data / "alpha_val.csv", graded_rows(lm, alpha, [True, True]))
    write_csv(data / "beta_val.csv", graded_rows(lm, beta, [True, False, False, True]))
    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.chdir(out)
    ceval_main(make_cfg(f"model.path={tiny_dir('qwen3')}", f"data={data}"))

    with open(out / "answers.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["subject"], r["id"]) for r in rows] == [("alpha", "0"), ("alpha", "1")] + [
        ("beta", str(i)) for i in range(4)
    ]
    assert [r["answer"] for r in rows] == [oracle_letter(lm, q) for q in alpha + beta]
    summary = json.loads((out / "ceval.json").read_text(encoding="utf-8"))
    assert summary["accuracy"] == 4 / 6 and summary["total"] == 6 and summary["correct"] == 4
    assert summary["subjects"]["alpha"] == {"accuracy": 1.0, "correct": 2, "total": 2}
    assert summary["subjects"]["beta"] == {"accuracy": 0.5, "correct": 2, "total": 4}
    assert summary["kv_reused_tokens"] > 0
    assert "overall" in capsys.readouterr().out


def test_file_without_answers_writes_only_answers(tiny_dir, tmp_path, monkeypatch):
    qs = questions("law")[:2]
    path = write_csv(tmp_path / "law_test.csv", [[q.id, q.question, *q.choices] for q in qs], HEADER[:-1])
    monkeypatch.chdir(tmp_path)
    ceval_main(make_cfg(f"model.path={tiny_dir('qwen3')}", f"data={path}"))
    with open(tmp_path / "answers.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["id", "answer"] and len(rows) == 3 and all(r[1] in LETTERS for r in rows[1:])
    assert not (tmp_path / "ceval.json").exists()


GOOD = ["1", "Q?", "a", "b", "c", "d", "A"]


@pytest.mark.parametrize(
    "bad, message",
    [
        (["2", "Q?", "a", "b", "c", "A"], "row 2 .*expected 7 fields"),
        (["2", "  ", "a", "b", "c", "d", "A"], "row 2 .*empty question"),
        (["2", "Q?", "a", "b", "c", "d", "E"], "row 2 .*'E' is not one of A, B, C, D"),
        (["1", "Q?", "a", "b", "c", "d", "B"], "row 2 .*duplicate id '1'"),
    ],
)
def test_malformed_row_is_one_line_naming_file_and_row(tmp_path, bad, message):
    path = write_csv(tmp_path / "x_val.csv", [GOOD, bad])
    with pytest.raises(UserError, match=message) as err:
        ceval.load_questions(path)
    assert "\n" not in str(err.value) and "x_val.csv" in str(err.value)


@pytest.mark.parametrize(
    "header, message",
    [
        (["id", "question", "A", "B", "C"], "no 'D' column"),
        (["id", "question", "A", "B", "C", "D", "solution"], "unexpected column 'solution'"),
    ],
)
def test_bad_header_is_refused(tmp_path, header, message):
    path = write_csv(tmp_path / "x.csv", [], header)
    with pytest.raises(UserError, match=message):
        ceval.read_csv(path)


def test_bad_data_and_dev_paths(tmp_path):
    with pytest.raises(UserError, match="no .csv files"):
        ceval.load_questions(tmp_path)
    with pytest.raises(UserError, match="no such file"):
        ceval.load_questions(tmp_path / "missing.csv")
    dev = tmp_path / "dev"
    dev.mkdir()
    write_csv(dev / "alpha_dev.csv", [GOOD])
    with pytest.raises(UserError, match="no examples for subject 'beta'"):
        ceval.shots_for(ceval.load_dev(dev), "beta", 5)
    no_answers = write_csv(tmp_path / "d.csv", [GOOD[:-1]], HEADER[:-1])
    with pytest.raises(UserError, match="need an 'answer' column"):
        ceval.load_dev(no_answers)


@pytest.mark.slow  # suite time; in-process: test_malformed_row_is_one_line_naming_file_and_row
def test_cli_malformed_row_is_one_line_error(tmp_path):
    path = write_csv(tmp_path / "bad_val.csv", [GOOD, ["2", "Q?", "a", "b", "c", "d", "Z"]])
    proc = run_cli("mode=ceval", f"data={path}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "bad_val.csv row 2" in lines[-1] and "'Z'" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_missing_data_and_bad_shots_fail_before_loading():
    with pytest.raises(UserError, match="needs data=FILE_OR_DIR"):
        ceval_main(make_cfg())
    with pytest.raises(UserError, match="ceval.shots must be an integer >= 0"):
        ceval_main(make_cfg("data=x.csv", "ceval.shots=-1"))
