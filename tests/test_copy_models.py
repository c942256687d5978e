"""The copy-trained pair behind the speculative-decoding benchmark (``scripts.train.train_copy``)
and the benchmark script itself.

The real pair trains for about a quarter of an hour, so it is never trained here: these tests
check what its usefulness rests on with miniature recipes (seconds): the training prompts are
exactly the pipeline's own, the loss sees only the answer, finished models are written whole
and reused, an interrupted one is retrained, and ``benchmarks/speculative.py`` runs every path
and insists on plain greedy's tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from conftest import ROOT
from pipeline import Pipeline, Request, load_model
from scripts.train import train_copy
from pipeline.testing.tokenizer import make_tokenizer
from pipeline.tiny import MARKER_FILE
from stages import DecodeLoop, Prefill, Tokenize

TINY = {
    "hidden": 32,
    "intermediate": 64,
    "heads": 2,
    "kv_heads": 2,
    "steps": 3,
    "warmup": 1,
    "short_steps": 1,
    "ramp_steps": 1,
    "batch": 4,
}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(train_copy.FAMILY)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A miniature target and draft trained by ``copy_models`` (the real code path, tiny sizes)."""
    root = tmp_path_factory.mktemp("copy")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_copy, "TARGET", replace(train_copy.TARGET, **TINY))
        mp.setattr(train_copy, "DRAFT", replace(train_copy.DRAFT, **{**TINY, "hidden": 16, "intermediate": 32}))
        target, draft = train_copy.copy_models(root, progress=False)
    return root, target, draft


def test_training_prompts_are_the_pipelines_own(tiny_dir, tok):
    """What the models learn from is what the Tokenize stage sends them at inference."""
    lm = load_model(str(tiny_dir("qwen3")))
    assert lm.tokenizer.get_vocab() == tok.get_vocab()
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()})
    task = train_copy.Task(tok)
    for name in train_copy.TASKS:
        example = train_copy.heldout(tok, 1, name)[0]
        got = pipe.run(Request(prompt=example.prompt, max_new_tokens=1))
        assert got.prompt_ids == task.prompt_ids(example), name


def test_the_loss_sees_the_answer_and_its_end_only(tok):
    task = train_copy.Task(tok)
    examples = task.examples(np.random.default_rng(0), 3, task="repeat")
    batch = task.batch(examples)
    for row, example in enumerate(examples):
        labels = batch["labels"][row]
        kept = labels[labels != -100].tolist()
        assert kept == tok(example.answer, add_special_tokens=False)["input_ids"] + [task.end]
        n = int(batch["attention_mask"][row].sum())
        assert batch["input_ids"][row, :n].tolist() == task.prompt_ids(example) + kept


def test_held_out_passages(tok):
    """Distinct words, 40-80 tokens (a translation: every cipher word, 34 tokens); a repeat
    answers with the passage, a translation with none of its words (so lookup has nothing
    right to propose there)."""
    for name in train_copy.TASKS:
        for example in train_copy.heldout(tok, 16, name):
            words = example.passage.rstrip(".").split()
            assert len(set(words)) == len(words)
            n = len(tok(" " + example.passage, add_special_tokens=False)["input_ids"])
            answer = example.answer.rstrip(".").split()
            if name == "repeat":
                assert train_copy.PASSAGE_TOKENS[0] - 2 <= n <= train_copy.PASSAGE_TOKENS[1] + 2, (n, example)
                assert answer == words
            else:
                assert n == len(train_copy.CIPHER) + 1 and sorted(words) == sorted(train_copy.CIPHER)
                assert not set(answer) & set(words) and len(answer) == len(words)
    assert train_copy.heldout(tok, 4, "repeat") == train_copy.heldout(tok, 4, "repeat")  # seeded


@pytest.mark.slow  # suite time: training the pair takes ~37 s on 2 cores; benchmark scaffolding, not a user path
def test_models_are_written_whole_and_reused(tiny_pair, monkeypatch):
    import torch

    root, target, draft = tiny_pair
    # training in this process left its deterministic mode behind: that mode fills every new
    # tensor, so a lazily used KV pool would be touched whole (the suite once grew to 23 GB)
    assert not torch.are_deterministic_algorithms_enabled()
    for d in (target, draft):
        marker = json.loads((d / MARKER_FILE).read_text())
        assert marker["trained"] == "copy" and marker["copy_version"] == train_copy.COPY_VERSION
        assert set(marker["heldout"]) == set(train_copy.TASKS) and "train_seconds" in marker
        assert load_model(str(d)).tokenizer.get_vocab() == load_model(str(target)).tokenizer.get_vocab()
    assert sorted(p.name for p in root.iterdir()) == ["copy-draft", "copy-target"]  # no leftovers

    def no_training(*args, **kwargs):
        raise AssertionError("a finished model was trained again")

    monkeypatch.setattr(train_copy, "train", no_training)
    assert train_copy.copy_models(root) == (target, draft)


@pytest.mark.slow  # suite time: needs the trained pair (above)
def test_an_interrupted_model_is_trained_again(tiny_pair, tmp_path, monkeypatch):
    import shutil

    _, target, draft = tiny_pair
    root = tmp_path / "pair"
    shutil.copytree(target, root / target.name)
    shutil.copytree(draft, root / draft.name)
    (root / draft.name / MARKER_FILE).unlink()  # as a run killed before its marker was written leaves it
    trained = []
    monkeypatch.setattr(train_copy, "train", lambda recipe, out, progress=True: trained.append(recipe.name))
    train_copy.copy_models(root, progress=False)
    assert trained == [train_copy.DRAFT_NAME]


@pytest.mark.slow  # a benchmark script end to end (8 s): its paths' tokens are checked by test_speculative
def test_benchmark_runs_every_path_and_keeps_the_tokens(tiny_pair, tmp_path):
    """The script on the miniature pair: every path (prompt lookup, the draft eager and compiled)
    must give plain greedy's tokens or it exits non-zero; its tables are written."""
    root, _, _ = tiny_pair
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "speculative.py"),
            "--models",
            str(root),
            "--prompts",
            "1",
            "--reps",
            "1",
            "--max-new-tokens",
            "24",
            "--paths",
            "plain,ngram-3,draft-2",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "speculative.json").read_text())["rows"]
    paths = {(r["workload"], r["path"]) for r in rows}
    assert {("copy", "draft-2"), ("no lookup", "ngram-3"), ("copy", "generate assistant")} <= paths
    assert all(r["same_as_plain"] == "1/1" for r in rows if r["path"].startswith("generate"))
    assert "| copy | ngram-3 |" in (tmp_path / "speculative.md").read_text()
