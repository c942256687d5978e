"""What a new user meets around the answer (issue 25): a misspelt key is refused with the closest
one, stdout of a sweep is only answers, metrics always carry preemptions, a failed run leaves no
folder, and the run's log file holds the run's report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from conftest import ROOT, run_cli
from doc_commands import documented_commands
from pipeline.cli import outputs
from pipeline.__main__ import CONF_DIR, check_group_choices, check_overrides
from pipeline.metrics import Metrics
from pipeline.cli.outputs import RunFolders, remove_failed_run_dir


def refusal(capsys, *argv: str) -> str:
    """check_overrides' one stderr line for argv (it must exit 2)."""
    with pytest.raises(SystemExit) as stop:
        check_overrides(list(argv))
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# --- 1. unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, line",
    [
        (["+max_new_token=5"], "error: Could not add 'max_new_token': no such setting; did you mean max_new_tokens=5?"),
        (
            ["++max_new_token=5"],
            "error: Could not add 'max_new_token': no such setting; did you mean max_new_tokens=5?",
        ),
        (["+model.pth=DIR"], "error: Could not add 'model.pth': no such setting; did you mean model.path=DIR?"),
        (
            ["-m", "+max_new_token=1,2"],
            "error: Could not add 'max_new_token': no such setting; did you mean max_new_tokens=1,2?",
        ),
        (["+foo=1"], "error: Could not add 'foo': no such setting; python -m pipeline --cfg job lists them"),
        (["foo=1"], "error: Could not override 'foo': no such setting; python -m pipeline --cfg job lists them"),
        (
            ["max_new_token=5"],
            "error: Could not override 'max_new_token': no such setting; did you mean max_new_tokens=5?",
        ),
        (
            ["sampler=sample", "+temperature=0.7"],
            "error: Could not add 'temperature': no such setting; did you mean sampler.temperature=0.7?",
        ),
        (
            ["ceval.shots=3"],
            "error: Could not override 'ceval.shots': the ceval settings are read with mode=ceval only",
        ),
    ],
)
def test_an_unknown_key_is_refused_with_the_closest_one(capsys, argv, line):
    assert refusal(capsys, *argv) == line


def test_the_refusal_of_an_unknown_key_does_not_advise_adding_it(capsys):
    assert "+foo" not in refusal(capsys, "foo=1")


@pytest.mark.parametrize(
    "argv",
    [
        ["+model=qwen3"],  # a config group
        ["+stages.check._target_=tests.helpers.RefusingStage", "+stages.check.arg=1"],  # a user's stage
        ["+stages.decode.compile_backend=aot_eager"],  # an argument of a stage
        ["+sampler.seed=3"],  # the sampler's class takes it
        ["+model.processor.do_pan_and_scan=true"],  # extra AutoProcessor kwargs
        ["+hydra.job.env_set.OMP_NUM_THREADS=1"],  # Hydra's own settings
        ["mode=ceval", "ceval.shots=3"],
        ["-m", "max_new_tokens=1,2", "quant=none,auto"],
    ],
)
def test_legitimate_overrides_pass(capsys, argv):
    check_overrides(argv)
    assert capsys.readouterr().err == ""


def assert_compose(commands: list, capsys) -> None:
    """Each command passes the checks the CLI makes before anything loads: its config group
    choices, and its composition against conf/ with every key known (each sweep value on its own)."""
    assert [str(c) for c in commands if "<" in c.text] == []  # a <placeholder> is a redirection to the shell
    for argv, command in {tuple(c.argv): c for c in reversed(commands)}.items():  # each first one named
        try:
            check_group_choices(list(argv))
            check_overrides(list(argv))
        except SystemExit:
            raise AssertionError(f"{command}: {capsys.readouterr().err}") from None
    assert capsys.readouterr().err == ""


def test_the_readmes_commands_compose(capsys):
    commands = [c for c in documented_commands() if c.page in ("README.md", "CONTRIBUTING.md")]
    assert len(commands) > 5
    assert_compose(commands, capsys)


@pytest.mark.slow  # suite time (about 25 s: each compose reads conf/); the README's above
def test_every_documented_command_composes(capsys):
    """Every ``-m pipeline`` command of the README, CONTRIBUTING.md and the docs site (read by
    tests/doc_commands.py, whose rule leaves ``...`` placeholders out)."""
    commands = documented_commands()
    assert len(commands) > 60
    assert_compose(commands, capsys)


@pytest.mark.slow  # suite time; in-process: test_an_unknown_key_is_refused_with_the_closest_one
def test_an_unknown_plus_key_is_one_line_from_the_cli(tmp_path):
    proc = run_cli("+max_new_token=5", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr == "error: Could not add 'max_new_token': no such setting; did you mean max_new_tokens=5?\n"
    assert proc.stdout == "" and not (tmp_path / "run").exists()


# --- 2, 3, 5. a sweep: stdout only answers, preemptions reported, each job's log holds its report ------


def test_hydra_logs_to_stderr():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", return_hydra_config=True)
    assert cfg.hydra.hydra_logging.handlers.console.stream == "ext://sys.stderr"
    assert cfg.hydra.job_logging.handlers.console.stream == "ext://sys.stderr"


def test_the_library_leaves_the_cycle_collector_as_it_is():
    """The CLI freezes its imports out of the cycle collector's reach (``settle_imports``); a
    program that imports the library, the entry point's module included, keeps its collector."""
    code = (
        "import gc; before = gc.get_threshold()\n"
        "import pipeline, pipeline.__main__, pipeline.cli.assemble\n"
        "from pipeline import Pipeline, load_model\n"
        "assert gc.get_threshold() == before and gc.get_freeze_count() == 0, (gc.get_threshold(), before)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_preemptions_are_reported_when_none():
    assert Metrics().to_dict()["preemptions"] == 0
    metrics = Metrics()
    metrics.count("preemptions")
    assert metrics.to_dict()["preemptions"] == 1


def test_a_sweep_prints_only_answers_and_logs_each_run(tmp_path):
    proc = run_cli("-m", "max_new_tokens=1,2", "ignore_eos=true", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    results = [json.loads((tmp_path / str(i) / "result.json").read_text()) for i in range(2)]
    assert [len(r["token_ids"]) for r in results] == [1, 2]  # one result per job, each with its own setting
    assert proc.stdout == "".join(r["text"] + "\n" for r in results)  # no "[HYDRA] Launching ..." among them
    assert "Launching 2 jobs locally" in proc.stderr and "#1 : max_new_tokens=2" in proc.stderr
    for i, result in enumerate(results):
        assert result["metrics"]["preemptions"] == 0
        log = (tmp_path / str(i) / "__main__.log").read_text()
        assert "mm-pipeline: no model chosen" in log and f"result: {tmp_path / str(i) / 'result.json'}" in log
        assert "preemptions" in log and "\r" not in log  # the metrics table; a progress bar's last state only
        assert "HYDRA" not in log


# --- 4. a failed run leaves no folder -----------------------------------------------------------


@pytest.mark.slow  # suite time; in-process: the failed-run cases below (hydra_job)
def test_a_failed_run_leaves_no_folder(tmp_path):
    proc = run_cli("model.path=/no/such/dir", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: model.path '/no/such/dir' does not exist"
    assert list(tmp_path.iterdir()) == []  # not even outputs/DATE


@pytest.fixture
def hydra_job(tmp_path):
    """job(run_dir, *written) -> a Hydra job's state as run_job leaves it (the folder, .hydra/ and the
    log created after RunFolders noted what existed), plus the files the job wrote."""
    saved = HydraConfig.instance().cfg

    def job(run: Path, *written: str) -> None:
        outputs._BEFORE.clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None, job_name="__main__"):
            cfg = compose("config", overrides=[f"hydra.run.dir={run}"], return_hydra_config=True)
        RunFolders().on_run_start(cfg)
        for name in (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "__main__.log", *written):
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            (run / name).touch()
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(run)
        HydraConfig.instance().set_config(cfg)

    yield job
    HydraConfig.instance().cfg = saved
    outputs._BEFORE.clear()


def test_a_failed_run_removes_the_folders_it_created(tmp_path, hydra_job):
    hydra_job(tmp_path / "outputs" / "day" / "time")
    remove_failed_run_dir()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_keeps_a_chosen_folder_and_its_files(tmp_path, hydra_job):
    (tmp_path / "mine.txt").write_text("the user's")
    hydra_job(tmp_path)
    remove_failed_run_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]  # only what the run added went


def test_a_failed_run_that_wrote_results_is_kept(tmp_path, hydra_job):
    hydra_job(tmp_path / "run", "results.part.jsonl")
    remove_failed_run_dir()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".hydra", "__main__.log", "results.part.jsonl"]
