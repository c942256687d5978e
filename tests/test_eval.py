"""lm-eval in-process (``pipeline.frontends.evaluation.EngineLM`` and ``mode=eval``): the same log-likelihoods,
perplexities and generations as lm-eval's own ``hf`` model on the same weights, a question's
choices sharing its context through the prefix cache, image tasks on a vision family, and the
CLI's results files and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli
from test_lm_eval import QUESTIONS, write_tasks
from pipeline import Pipeline, Request, UserError
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

pytest.importorskip("lm_eval")

CONTEXT = (
    "Read the passage and finish the sentence. The harbour town wakes early: boats leave before dawn, "
    "the market opens at six, and by noon the square is full of people buying fish and bread. "
)
IMAGE_QUESTIONS = ["What colour is it?", "Name the colour."]
SHARED = [
    (CONTEXT + "In the morning the boats", [" leave the harbour", " sing", " sleep all day", " fly"], 0),
    (CONTEXT + "At noon the square is", [" full of people", " empty", " under water", " on fire"], 0),
]


def write_shared_task(folder) -> None:
    """A multiple-choice task whose questions share a long context (several KV blocks)."""
    (folder / "shared.jsonl").write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in SHARED)
    )
    (folder / "mm_shared.yaml").write_text(
        f"task: mm_shared\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'shared.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )


def write_image_task(folder) -> list:
    """A generate_until task with an ``<image>`` placeholder and a PIL image per document (parquet)."""
    import datasets
    from PIL import Image

    images = [Image.new("RGB", (56, 56), c) for c in ((200, 30, 30), (20, 160, 40))]
    data = datasets.Dataset.from_dict({"image": images, "question": IMAGE_QUESTIONS, "answer": ["red", "green"]})
    data.cast_column("image", datasets.Image()).to_parquet(str(folder / "images.parquet"))
    (folder / "mm_image.yaml").write_text(
        "task: mm_image\ndataset_path: parquet\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'images.parquet'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_image: [image]\n"
        "doc_to_text: '<image>{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n"
    )
    return images


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The local tasks' folder, and one TaskManager over it (indexing lm-eval's tasks takes seconds)."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("eval-tasks")
    write_tasks(folder)
    write_shared_task(folder)
    images = write_image_task(folder)
    return folder, TaskManager(include_path=str(folder)), images


def evaluate(model, tasks, names: list[str], **kwargs) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=model, tasks=names, task_manager=tasks[1], log_samples=True, **kwargs)


def responses(out: dict, task: str) -> list:
    return [r[0] for s in out["samples"][task] for r in s["resps"]]


def test_engine_lm_equals_lm_evals_hf_model(load_tiny, tasks):
    """Multiple choice, rolling perplexity and generation: every figure lm-eval's HFLM reports."""
    from lm_eval.models.huggingface import HFLM

    from pipeline.frontends.evaluation import EngineLM

    lm = load_tiny("qwen3")
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=32 << 20)
    names = ["mm_mc", "mm_shared", "mm_rolling", "mm_gen"]
    ours = evaluate(EngineLM(pipe, progress=False), tasks, names)
    theirs = evaluate(HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=4), tasks, names)
    for task in ("mm_mc", "mm_shared"):
        mine, ref = responses(ours, task), responses(theirs, task)
        assert [v for v, _ in mine] == pytest.approx([v for v, _ in ref], abs=1e-4)
        assert [g for _, g in mine] == [g for _, g in ref]
        assert ours["results"][task]["acc,none"] == theirs["results"][task]["acc,none"]
    assert responses(ours, "mm_rolling") == pytest.approx(responses(theirs, "mm_rolling"), abs=1e-3)
    assert responses(ours, "mm_gen") == responses(theirs, "mm_gen")


def test_a_questions_choices_share_its_context(load_tiny, tasks):
    """Each question's first choice computes the context; the other three find it in the prefix
    cache, so the engine computes far fewer tokens than the requests hold."""
    from pipeline.frontends.evaluation import EngineLM

    lm = load_tiny("qwen3")
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=32 << 20)
    model = EngineLM(pipe, progress=False)
    before = pipe.engine.counters["tokens_in"]
    out = evaluate(model, tasks, ["mm_shared"])
    fed = pipe.engine.counters["tokens_in"] - before
    held = sum(len(model.tok_encode(c + x)) for s in out["samples"]["mm_shared"] for c, x in s["arguments"])
    context = len(model.tok_encode(CONTEXT))
    assert context > 32 and fed <= held - 2 * 3 * (context // 16 * 16)  # 3 of 4 choices reuse its full blocks


def test_image_tasks_generate_as_the_chain_does(load_tiny, tasks):
    """lm-eval's multimodal generate_until requests (an ``<image>`` placeholder and a PIL image)
    on a vision family: the same answer as the chain run directly on that image and question."""
    from pipeline.frontends.evaluation import EngineLM

    lm = load_tiny("qwen2-vl")
    pipe = Pipeline(
        lm,
        {"tokenize": Tokenize(), "vision": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()},
        kv_memory=32 << 20,
    )
    out = evaluate(EngineLM(pipe, progress=False), tasks, ["mm_image"])
    answers = [s["resps"][0][0] for s in sorted(out["samples"]["mm_image"], key=lambda s: s["doc_id"])]
    stop = ["\n\n", lm.tokenizer.eos_token]
    direct = [
        pipe.run(Request(prompt=q, images=[im], max_new_tokens=6, stop=stop)).text
        for q, im in zip(IMAGE_QUESTIONS, tasks[2])
    ]
    assert answers == direct and len(answers) == 2


def test_chat_template_generation_runs_the_same_messages_through_the_chain(load_tiny, tasks):
    """lm-eval's apply_chat_template=True: the prompt it renders is the model's own template over
    its messages, and the answer is the chain's for those messages."""
    from pipeline.frontends.evaluation import EngineLM

    lm = load_tiny("qwen3")
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=32 << 20)
    out = evaluate(EngineLM(pipe, progress=False, thinking=False), tasks, ["mm_gen"], apply_chat_template=True)
    samples = sorted(out["samples"]["mm_gen"], key=lambda s: s["doc_id"])
    stop = [".", lm.tokenizer.eos_token]
    for sample, (question, _, _) in zip(samples, QUESTIONS):
        assert "<|im_start|>user" in sample["arguments"][0][0]
        direct = pipe.run(
            Request(messages=[{"role": "user", "content": question}], max_new_tokens=5, stop=stop, thinking=False)
        )
        assert sample["resps"][0][0] == direct.text


def test_unsupported_generation_settings_are_named(load_tiny):
    from pipeline.frontends.evaluation import EngineLM

    model = EngineLM(Pipeline(load_tiny("qwen3"), {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=8 << 20))
    with pytest.raises(UserError, match="num_beams are not supported"):
        model._generation(0, "Hello", {"until": ["."], "num_beams": 4})
    assert (
        model._generation(0, "Hello", {"do_sample": True, "temperature": 0.5, "seed": 1}).request.sampler.temperature
        == 0.5
    )


@pytest.mark.parametrize("quant, scheme", [(None, "none"), ("int8wo", "int8wo")])
def test_mode_eval_writes_results_and_a_table(held_out_dir, tasks, tmp_path, monkeypatch, capsys, quant, scheme):
    """On a checkpoint the project did not build, where quant=auto would load int8 weights, eval
    keeps the checkpoint's (its scores then compare with lm-eval's hf model) and says so; an
    explicit quant= is honoured and recorded."""
    from pipeline.modes import eval as eval_mode
    from pipeline.modes import processes

    monkeypatch.setattr(processes, "run_dir", lambda: tmp_path)
    monkeypatch.setattr(eval_mode, "task_manager", lambda include_path: tasks[1])  # indexed once per module
    eval_mode.main(
        make_cfg(
            f"model.path={held_out_dir('qwen3')}",
            "eval.tasks=[mm_mc,mm_rolling]",
            f"eval.include_path={tasks[0]}",
            "eval.limit=2",
            "eval.log_samples=true",
            *([f"quant={quant}"] if quant else []),
        )
    )
    out = capsys.readouterr()
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["results"]["mm_mc"]["sample_len"] == 2 and "word_perplexity,none" in results["results"]["mm_rolling"]
    assert results["config"]["quant"] == scheme
    weights = next(line for line in out.err.splitlines() if line.startswith("weights ("))
    if quant is None:
        assert weights.startswith("weights (quant=none): quant=auto keeps the checkpoint's weights under mode=eval")
    else:
        assert weights == "weights (quant=int8wo):"
    assert "mm_mc" in (tmp_path / "results.md").read_text() and "mm_mc" in out.out
    assert len((tmp_path / "samples_mm_mc.jsonl").read_text().splitlines()) == 2
    assert "loglikelihood" in out.err  # the progress bar


def make_cfg(*overrides: str):
    from hydra import compose, initialize_config_dir

    from pipeline.__main__ import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=["mode=eval", "model.path=/nonexistent", "kv.memory=67108864", *overrides])


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "mode=eval needs eval.tasks="),
        (["eval.tasks=[mm_mc]", "eval.limit=-3"], "eval.limit must be an integer >= 1"),
        (["eval.tasks=mm_mc", "eval.include_path=/nonexistent"], "eval.include_path '/nonexistent' is not a folder"),
        (["eval.tasks=mm_mc", "eval.adapter=sql"], r"eval.adapter=sql: not in model.lora"),
    ],
)
def test_mode_eval_refuses_bad_settings_before_loading(args, message):
    from pipeline.modes.eval import main

    with pytest.raises(UserError, match=message):
        main(make_cfg(*args))


def test_an_unknown_task_is_named_with_the_closest_ones(tasks):
    from pipeline.modes.eval import check_tasks

    check_tasks(tasks[1], ["mm_mc", "mm_*", "arc_easy"])
    with pytest.raises(UserError, match=r"unknown lm-eval task 'mm_nope' \(did you mean mm_"):
        check_tasks(tasks[1], ["mm_mc", "mm_nope"])


def test_mode_eval_without_lm_eval_says_how_to_install(monkeypatch):
    from pipeline.modes.eval import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now fails as if not installed
    with pytest.raises(UserError, match=r"pip install 'mm-pipeline\[eval\]'"):
        main(make_cfg("eval.tasks=[x]"))


@pytest.mark.slow  # two processes, each loading lm-eval's task index (python -m pytest -m slow)
def test_two_process_accelerate_launch_equals_one_process(tiny_dir, tasks, tmp_path):
    """Data parallel as for batch: lm-eval splits the documents over the processes and gathers
    every sample on the first; the results equal one process's."""
    from serving import free_port

    common = [
        "-m",
        "pipeline",
        "mode=eval",
        f"model.path={tiny_dir('qwen3')}",
        "eval.tasks=[mm_mc,mm_gen]",
        f"eval.include_path={tasks[0]}",
        "eval.log_samples=true",
    ]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        *common,
        f"hydra.run.dir={tmp_path / 'two'}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = run_cli(*common[2:], "model.device_map=cpu", f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]

    def samples(folder, task):
        rows = [json.loads(line) for line in (tmp_path / folder / f"samples_{task}.jsonl").read_text().splitlines()]
        return sorted((r["doc_id"], r["filtered_resps"]) for r in rows)

    for task in ("mm_mc", "mm_gen"):
        two, single = samples("two", task), samples("one", task)
        assert len(two) == len(single) == 3
        assert [d for d, _ in two] == [d for d, _ in single]
        for (_, a), (_, b) in zip(two, single):
            if task == "mm_mc":  # [[log-likelihood, is greedy] per choice]
                assert [float(x[0]) for x in a] == pytest.approx([float(x[0]) for x in b], abs=1e-4)
            else:
                assert a == b
    results = [json.loads((tmp_path / f / "results.json").read_text())["results"] for f in ("two", "one")]
    assert results[0]["mm_mc"]["acc,none"] == results[1]["mm_mc"]["acc,none"]


def test_an_adapter_scores_as_lm_evals_hf_model_on_peft_merged_weights(held_out_dir, tasks, tmp_path):
    from lm_eval.models.huggingface import HFLM

    from pipeline.frontends.evaluation import EngineLM
    from pipeline.model.loading import load_model
    from pipeline.testing.lora import make_adapter, merged_model

    base = held_out_dir("qwen3")
    path = make_adapter(base, tmp_path / "a", seed=1)
    lm = load_model(str(base), quant="none")
    lm.load_adapter("a", str(path))
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=32 << 20)
    names = ["mm_mc", "mm_gen"]
    ours = evaluate(EngineLM(pipe, progress=False, adapter="a"), tasks, names)
    theirs = evaluate(HFLM(pretrained=merged_model(base, path), tokenizer=lm.tokenizer, batch_size=4), tasks, names)
    base_scores = evaluate(EngineLM(pipe, progress=False), tasks, ["mm_mc"])
    assert [v for v, _ in responses(ours, "mm_mc")] == pytest.approx(
        [v for v, _ in responses(theirs, "mm_mc")], abs=1e-4
    )
    assert [v for v, _ in responses(ours, "mm_mc")] != pytest.approx([v for v, _ in responses(base_scores, "mm_mc")])
    assert responses(ours, "mm_gen") == responses(theirs, "mm_gen")
