"""Settings refused before anything heavy loads (issue 25): one ``error:`` line, exit status 2.

- ``model.max_memory`` naming a CUDA device that is not here (the docs' ``{0: 10GiB, cpu: 30GiB}``
  on a machine without CUDA) is refused where the configuration enters, not by a traceback from
  deep in transformers;
- a hub id the hub cannot be asked about (no network) and that is not cached is one line at
  once, not half a minute of retry warnings; a cached one loads from the cache without retries;
- ``kv.memory`` in bytes below one KV block, and ``kv.state_checkpoint_every`` on a model without
  linear-attention layers, are judged on config.json before the weights load.

The hub is simulated: ``HF_ENDPOINT`` on a local port nothing listens on (no answer) or a local
server answering 404, and ``HF_HUB_CACHE`` in a temporary folder, so the tests do the same with
or without network.
"""

from __future__ import annotations

import http.server
import shutil
import threading
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants
from hydra import compose, initialize_config_dir

from conftest import run_cli
from pipeline.cli import assemble
from pipeline.model import loading
from pipeline.cli.assemble import check_kv_bytes_hold_a_block, check_settings_for_model, check_state_checkpoint_setting
from pipeline.errors import UserError
from pipeline.model.loading import check_hub_reachable, load_model, local_files_only, parse_max_memory, read_config
from pipeline.memory import kv_bytes
from pipeline.cli.settings import KVSettings, check
from pipeline.tiny import default_model_dir

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
README_MAX_MEMORY = "model.max_memory={0: 10GiB, cpu: 30GiB}"
NO_ANSWER = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once
NO_CUDA = (
    "model.max_memory names CUDA device 0 but no CUDA device is available: use {cpu: 30GiB} or drop model.max_memory"
)


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=list(overrides))


def one_line_error(proc) -> str:
    """The run failed as the CLI promises: exit 2, no traceback, one ``error:`` line (returned)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


# --- model.max_memory ----------------------------------------------------------------------------


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_readme_max_memory_without_cuda_is_refused_where_the_config_enters(no_cuda):
    with pytest.raises(UserError) as err:
        check(make_cfg(README_MAX_MEMORY))
    assert str(err.value) == NO_CUDA
    with pytest.raises(UserError, match=r"CUDA devices 0, 1 but .*: drop model.max_memory$"):
        parse_max_memory({0: "1GiB", "cuda:1": "1GiB"})
    assert parse_max_memory({"cpu": "30GiB"}) == {"cpu": 30 << 30}
    check(make_cfg("model.max_memory={cpu: 30GiB}"))  # the fix the message names passes


def test_max_memory_naming_a_gpu_index_beyond_the_ones_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert parse_max_memory({0: "10GiB", "cpu": "30GiB"}) == {0: 10 << 30, "cpu": 30 << 30}
    with pytest.raises(
        UserError,
        match=r"names CUDA device 1 but only 1 CUDA device\(s\) are here \(0-0\): "
        r"use \{0: 10GiB, cpu: 30GiB\} or drop",
    ):
        parse_max_memory({0: "10GiB", 1: "10GiB", "cpu": "30GiB"})


@pytest.mark.slow  # the same refusal in-process above; this is its CLI line (suite time)
def test_readme_max_memory_example_on_the_cli_without_cuda(tmp_path):
    proc = run_cli(README_MAX_MEMORY, f"hydra.run.dir={tmp_path}", env={"CUDA_VISIBLE_DEVICES": ""})
    assert one_line_error(proc) == f"error: {NO_CUDA}"
    assert "Loading weights" not in proc.stderr


# --- hub ids -------------------------------------------------------------------------------------


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A hub that does not answer and an empty cache; ``hub.cache(id)`` puts the embedded model there."""
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "ENDPOINT", NO_ANSWER)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loading.hub_unreachable.cache_clear()

    class Hub:
        def cache(self, repo_id: str) -> None:
            commit = "0123456789abcdef0123456789abcdef01234567"
            repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
            (repo / "refs").mkdir(parents=True)
            (repo / "refs" / "main").write_text(commit)
            shutil.copytree(default_model_dir(), repo / "snapshots" / commit)

    yield Hub()
    loading.hub_unreachable.cache_clear()


def test_hub_id_without_network_is_one_line(hub):
    for refuse in (check_hub_reachable, read_config):
        with pytest.raises(UserError) as err:
            refuse("no-such-org/not-cached")
        message = str(err.value)
        assert message.startswith("cannot reach the Hugging Face hub to fetch 'no-such-org/not-cached' (no network? ")
        assert message.endswith(
            "download it elsewhere and pass model.path=DIR, or set HF_HUB_OFFLINE=1 to use the local cache only"
        )
        assert "\n" not in message


def test_cached_hub_id_without_network_loads_from_the_cache(hub, caplog):
    """The real loading path (from_pretrained), told to read the cache alone: offline, transformers
    would otherwise ask the hub about every file, each request retried five times (minutes)."""
    hub.cache("tiny-org/shapes")
    assert local_files_only("tiny-org/shapes") and not local_files_only(str(default_model_dir()))
    lm = load_model("tiny-org/shapes")
    assert lm.path == "tiny-org/shapes" and lm.family.name == load_model(str(default_model_dir())).family.name
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]


def test_a_hub_that_answers_is_left_to_from_pretrained(hub, monkeypatch):
    """A hub that answers, even with an error (here: 404 for everything), is not "unreachable":
    nothing is refused and nothing is read from the cache alone, so transformers reports its own
    error (no such repo, gated) or downloads."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert loading.hub_unreachable("some-org/missing") is None
        check_hub_reachable("some-org/missing")
        hub.cache("some-org/missing")
        assert not local_files_only("some-org/missing")  # cached, but the hub answers: the normal path
    finally:
        server.shutdown()


def test_hub_id_without_network_on_the_cli(tmp_path):
    """Before: 28 s and 23 lines of retry warnings (each twice) before the error."""
    proc = run_cli(
        "model.path=no-such-org/not-cached",
        f"hydra.run.dir={tmp_path}",
        env={
            "HF_ENDPOINT": NO_ANSWER,
            "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
        },
    )
    error = one_line_error(proc)
    assert error.startswith("error: cannot reach the Hugging Face hub to fetch 'no-such-org/not-cached'")
    hub_lines = [
        line
        for line in proc.stderr.splitlines()
        if any(word in line.lower() for word in ("retry", "retrying", "huggingface", "hugging face", NO_ANSWER))
    ]
    assert hub_lines == [error], proc.stderr


# --- kv settings judged on config.json -----------------------------------------------------------


@pytest.fixture(scope="module")
def default_config():
    return read_config(str(default_model_dir()))


@pytest.fixture(scope="module")
def recurrent_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig()  # Qwen3.5's layer pattern: linear attention with a full-attention layer every 4


def test_kv_memory_below_one_block_is_refused(default_config, recurrent_config):
    block = kv_bytes(default_config, 16, torch.float32)
    for memory in (1, block - 1):
        with pytest.raises(UserError) as err:
            check_kv_bytes_hold_a_block(memory, 16, 1024, default_config, [torch.float32], "shapes")
        assert str(err.value) == (
            f"kv.memory={memory:,} bytes cannot hold one KV block of 16 tokens ({block:,} "
            "bytes for shapes in float32): raise kv.memory or use kv.memory=auto"
        )
    check_kv_bytes_hold_a_block(block, 16, 1024, default_config, [torch.float32], "shapes")
    # the smallest dtype the cache may use decides: never refuse what the pool would take
    check_kv_bytes_hold_a_block(block // 2, 16, 1024, default_config, [torch.float32, torch.bfloat16], "shapes")
    # a model with linear-attention layers also needs one sequence's recurrent-state slots
    with pytest.raises(UserError, match="plus the recurrent-state slots of one sequence"):
        check_kv_bytes_hold_a_block(
            kv_bytes(recurrent_config, 16, torch.float32), 16, 1024, recurrent_config, [torch.float32], "qwen3.5"
        )
    check_kv_bytes_hold_a_block(1 << 30, 16, 1024, recurrent_config, [torch.float32], "qwen3.5")
    # an int8 pool's block is smaller: what it would take is not refused, what it would not is, by its size
    small = kv_bytes(default_config, 16, torch.float32, kv_dtype="int8")
    check_kv_bytes_hold_a_block(small, 16, 1024, default_config, [torch.float32], "shapes", "int8")
    with pytest.raises(UserError, match=f"one KV block of 16 tokens \\({small:,} bytes for shapes in kv.dtype=int8\\)"):
        check_kv_bytes_hold_a_block(small - 1, 16, 1024, default_config, [torch.float32], "shapes", "int8")


def test_offload_that_the_pool_cannot_serve_is_refused_before_loading(default_config, recurrent_config):
    from pipeline.cli.assemble import check_offload_setting

    check_offload_setting("disk", default_config, 1, "shapes")
    check_offload_setting("none", recurrent_config, 2, "qwen3.5")
    with pytest.raises(UserError, match="^kv.offload keeps key/value blocks only: qwen3.5's linear-attention"):
        check_offload_setting("host", recurrent_config, 1, "qwen3.5")
    with pytest.raises(UserError, match="^kv.offload under tensor parallel is not supported"):
        check_offload_setting("disk", default_config, 2, "shapes")


def test_state_checkpoint_every_is_for_linear_attention_models(default_config, recurrent_config):
    with pytest.raises(UserError) as err:
        check_state_checkpoint_setting(64, default_config, "shapes")
    assert str(err.value) == (
        "kv.state_checkpoint_every applies to models with linear-attention layers (Qwen3.5); "
        "shapes has none: drop the setting"
    )
    check_state_checkpoint_setting(KVSettings.state_checkpoint_every, default_config, "shapes")  # the default
    check_state_checkpoint_setting(64, recurrent_config, "qwen3.5")
    assert make_cfg().kv.state_checkpoint_every == KVSettings.state_checkpoint_every  # conf/ and the schema agree


@pytest.mark.parametrize(
    "override, message",
    [
        ("kv.memory=1", "kv.memory=1 bytes cannot hold one KV block of 16 tokens"),
        ("kv.state_checkpoint_every=64", "kv.state_checkpoint_every applies to models with linear-attention layers"),
    ],
)
def test_model_dependent_kv_settings_are_refused_before_the_weights_load(monkeypatch, override, message):
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(assemble, "load_model", no_weights)
    cfg = make_cfg(override, "model.dtype=float32")
    check(cfg)  # the settings alone are fine: only the model's config refuses them
    with pytest.raises(UserError, match=message) as err:
        assemble.load_from_cfg(cfg)
    assert "\n" not in str(err.value) and "the embedded default model" in str(err.value)
    # the default (here written out) and a byte count that holds blocks reach the loading
    for fine in (["kv.state_checkpoint_every=1024"], ["kv.memory=1000000"]):
        with pytest.raises(AssertionError, match="the weights were loaded"):
            assemble.load_from_cfg(make_cfg(*fine))


def test_settings_for_model_name_the_chosen_model():
    path = str(default_model_dir())
    cfg = make_cfg(f"model.path={path}", "kv.state_checkpoint_every=64")
    with pytest.raises(UserError, match=f"; {Path(path).name} has none: drop the setting"):
        check_settings_for_model(cfg, read_config(path), path)


@pytest.mark.slow  # the same refusal in-process above; this is its CLI line (suite time)
def test_kv_memory_below_one_block_on_the_cli(tmp_path):
    proc = run_cli("kv.memory=1", f"hydra.run.dir={tmp_path}")
    error = one_line_error(proc)
    assert error.startswith("error: kv.memory=1 bytes cannot hold one KV block of 16 tokens (")
    assert "Loading weights" not in proc.stderr
