"""EleutherAI's lm-evaluation-harness, unchanged, against ``mode=serve``: ``local-completions``
(prompts as token ids, its remote tokenizer through /tokenize) for loglikelihood,
loglikelihood_rolling and generate_until tasks, and ``local-chat-completions`` for
generate_until, on local task files. Every log-likelihood it records equals a plain
transformers forward's (the oracle)."""

from __future__ import annotations

import json

import pytest

from conftest import logprob_oracle
from serving import serving_tiny


QUESTIONS = [
    ("The sky on a clear day is", [" blue", " green", " loud", " square"], 0),
    ("Two plus two equals", [" four", " five", " seven", " blue"], 0),
    ("A cat says", [" meow", " moo", " quack", " tweet"], 0),
]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Rain falls on the hills in the north."]


def write_tasks(folder) -> None:
    """Three local tasks, one per request type lm-eval sends."""
    (folder / "mc.jsonl").write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS)
    )
    (folder / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))

    def task(name: str, data: str, body: str) -> None:
        (folder / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / data}\n"
            f"test_split: test\n{body}"
        )

    task(
        "mm_mc",
        "mc.jsonl",
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
    )
    task(
        "mm_rolling",
        "text.jsonl",
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n",
    )
    task(
        "mm_gen",
        "mc.jsonl",
        "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[answer]}}'\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 5\n"
        "metric_list:\n  - metric: exact_match\n",
    )


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    with serving_tiny(tmp_path_factory.mktemp("serve-lm-eval"), tiny_dir("qwen3"), "tiny") as server:
        yield server


def evaluate(server, tmp_path, model: str, tasks: list[str], **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    endpoint = "chat/completions" if "chat" in model else "completions"
    return simple_evaluate(
        model=model,
        model_args=f"model=tiny,base_url={server.url}/v1/{endpoint},num_concurrent=2",
        tasks=tasks,
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        **kwargs,
    )


def logprob(lm, context: list[int], continuation: list[int]) -> float:
    rows = logprob_oracle(lm, context + continuation)
    return sum(float(rows[len(context) - 1 + i, t]) for i, t in enumerate(continuation))


def test_local_completions_scores_equal_the_oracle(server, tmp_path):
    out = evaluate(server, tmp_path, "local-completions", ["mm_mc", "mm_rolling", "mm_gen"])
    tok, lm = server.lm.tokenizer, server.lm

    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    mc = out["samples"]["mm_mc"]
    assert len(mc) == len(QUESTIONS)
    for sample in mc:
        for (context, continuation), (value, _greedy) in zip(
            (r for r in sample["arguments"]), (r[0] for r in sample["resps"])
        ):
            whole, ctx = encode(context + continuation), encode(context)
            assert value == pytest.approx(logprob(lm, ctx, whole[len(ctx) :]), abs=1e-3)
    prefix = encode(tok.eos_token)
    for sample in out["samples"]["mm_rolling"]:
        text = sample["arguments"][0][0]
        assert sample["resps"][0][0] == pytest.approx(logprob(lm, prefix, encode(text)), abs=1e-3)
    assert all(isinstance(s["resps"][0][0], str) for s in out["samples"]["mm_gen"])
    assert out["results"]["mm_mc"]["acc,none"] is not None


@pytest.mark.slow  # lm-eval end to end a second time (python -m pytest -m slow)
def test_local_chat_completions_generates(server, tmp_path):
    out = evaluate(server, tmp_path, "local-chat-completions", ["mm_gen"], apply_chat_template=True)
    answers = [s["resps"][0][0] for s in out["samples"]["mm_gen"]]
    assert len(answers) == len(QUESTIONS) and all(isinstance(a, str) for a in answers)
