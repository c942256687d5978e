"""Tensor parallel (model.tp=N): two ranks on gloo give the single process's tokens; what cannot
work is refused in one line before any weight loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from conftest import generate_oracle
from serving import free_port
from pipeline import Pipeline, Request, UserError, follow, load_model
from pipeline.model import tensor_parallel
from pipeline.kv.sizing import pool_bytes_for
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "the river runs past the stone bridge and the old mill where the birds sing at night " * 2


def text_requests() -> list[Request]:
    """16 mixed requests: half share a long prefix (prefix-cache hits once the first is cached)."""
    words = "sea sky cloud river stone light wind tree bird song night day fire snow rain road".split()
    out = []
    for i in range(16):
        tail = " ".join(words[(i * 7 + j) % len(words)] for j in range(3 + (i * 5) % 30))
        out.append(Request(prompt=(PREFIX if i % 2 else "") + tail, max_new_tokens=4 + i % 9, ignore_eos=bool(i % 3)))
    return out


def stages(vision: bool) -> dict:
    front = {"tokenize": Tokenize(), **({"vision_encoder": VisionEncoder()} if vision else {})}
    return {**front, "prefill": Prefill(chunk_size=32), "decode": DecodeLoop()}


def run_requests(lm, requests: list[Request], vision: bool, **engine) -> tuple[list[list[int]], dict]:
    pipe = Pipeline(lm, stages(vision), **engine)
    first = [pipe.submit(r) for r in requests[:2]]  # cached first: the later ones hit the prefix cache
    done = [h.result(timeout=600).token_ids for h in first]
    handles = [pipe.submit(r) for r in requests[2:]]
    return done + [h.result(timeout=600).token_ids for h in handles], pipe.engine.stats()


def _rank(
    rank: int, port: int, model_dir: str, out: str, vision: bool, kv_tokens: int, kv_dtype: str, quant: str
) -> None:
    """One rank of a 2-rank launch: rank 0 runs the requests, rank 1 follows."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    lm = load_model(model_dir, dtype="float32", tp=2, quant=quant)
    if rank > 0:
        follow(lm)
        return
    requests = image_requests() if vision else text_requests()
    memory = pool_bytes_for(lm, kv_tokens, 16, 1024, 16, kv_dtype)
    tokens, stats = run_requests(
        lm, requests, vision, kv_memory=memory, max_seqs=16, max_batch_tokens=96, kv_dtype=kv_dtype
    )
    Path(out).write_text(json.dumps({"tokens": tokens, "stats": stats, "quant": lm.quant, "note": lm.quant_note}))
    tensor_parallel.finish()


def image_requests() -> list[Request]:
    from PIL import Image

    pictures = [Image.new("RGB", (56, 84), (200, 30, 30)), Image.new("RGB", (84, 56), (30, 30, 200))]
    return [Request(prompt="What is in the image?", images=[p], max_new_tokens=8, ignore_eos=True) for p in pictures]


def two_ranks(
    tmp_path: Path, model_dir: Path, vision: bool, kv_tokens: int, kv_dtype: str = "auto", quant: str = "none"
) -> dict:
    port = free_port()
    out = tmp_path / "rank0.json"
    mp.start_processes(
        _rank,
        args=(port, str(model_dir), str(out), vision, kv_tokens, kv_dtype, quant),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "quant, kv_dtype",
    [
        ("auto", "auto"),  # a checkpoint the project did not build: int8wo, sharded as one process holds it
        pytest.param("none", "auto", marks=pytest.mark.slow),  # suite time; full precision: tests/test_tp_launch.py
        pytest.param("none", "int8", marks=pytest.mark.slow),  # 9 s more
        pytest.param("int8wo", "int8", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_equal_one_process_with_prefix_hits_and_preemption(tiny_dir, held_out_dir, tmp_path, quant, kv_dtype):
    """The same settings give the same weights and tokens: under ``quant=auto`` both pick int8wo,
    and a row split over the ranks keeps the whole row's scale. int8 keys and values too: scales are
    per position and head, and each rank holds whole heads, so two ranks store exactly the bytes one
    process would."""
    model_dir = tiny_dir("llama") if quant == "none" else held_out_dir("llama")
    got = two_ranks(
        tmp_path, model_dir, vision=False, kv_tokens=320, kv_dtype=kv_dtype, quant=quant
    )  # 20 blocks a rank
    stats = got["stats"]
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0 and stats["tp_ranks"] == 2
    assert 0 < stats["tp_collective_share"] < 1  # gloo's all-reduces, sampled with torch.profiler
    lm = load_model(str(model_dir), dtype="float32", quant=quant)
    assert got["quant"] == lm.quant == ("none" if quant == "none" else "int8wo")
    if quant == "auto":
        assert got["note"] == lm.quant_note + "; sharded over the 2 tensor-parallel ranks"
    alone, _ = run_requests(lm, text_requests(), False, max_seqs=1, kv_dtype=kv_dtype)
    assert got["tokens"] == alone
    if kv_dtype != "auto":
        return  # generate() has full-precision keys
    pipe = Pipeline(lm, stages(False))
    for request, tokens in zip(text_requests()[:4], got["tokens"]):
        ids = torch.tensor([pipe.run(request).prompt_ids])
        assert tokens == generate_oracle(lm, ids, request.max_new_tokens, ignore_eos=request.ignore_eos)


@pytest.mark.slow  # suite time: the text-model case above keeps two ranks in the default run
@pytest.mark.parametrize("quant", ["none", "auto"])
def test_qwen2_vl_with_images_on_two_ranks(tiny_dir, held_out_dir, tmp_path, quant):
    model_dir = tiny_dir("qwen2-vl") if quant == "none" else held_out_dir("qwen2-vl")
    got = two_ranks(tmp_path, model_dir, vision=True, kv_tokens=1024, quant=quant)
    lm = load_model(str(model_dir), dtype="float32", quant=quant)
    assert got["quant"] == lm.quant
    alone, _ = run_requests(lm, image_requests(), True, max_seqs=1)
    assert got["tokens"] == alone


@pytest.mark.parametrize("arch", [pytest.param("llava", marks=pytest.mark.slow), "paligemma"])
def test_a_generic_vision_model_on_two_ranks(tmp_path, arch):
    """A checkpoint no family knows (LLaVA's patch runs; PaliGemma's prefix attended both ways), sharded by
    its architecture's own plan under the default quant: the single process's tokens. PaliGemma runs by
    default: its output layer is tied to its embeddings (as Gemma's, Llama 3.2 1B's), which two ranks
    once split for the logits while the embedding needed it whole."""
    import vlm_models

    model_dir = vlm_models.build(arch, tmp_path / arch)
    got = two_ranks(tmp_path, model_dir, vision=True, kv_tokens=1024, quant="auto")
    lm = load_model(str(model_dir), dtype="float32", quant="auto")
    assert lm.family.name == "vision" and got["quant"] == lm.quant == "int8wo"
    alone, _ = run_requests(lm, image_requests(), True, max_seqs=1)
    assert got["tokens"] == alone


def test_kv_pool_holds_a_rank_s_share_of_the_heads(tiny_dir):
    from pipeline.kv import BlockPool

    config = load_model(str(tiny_dir("llama")), dtype="float32").config
    whole, half = (BlockPool(config, 4, 16, torch.float32, [], shards=n) for n in (1, 2))
    assert half.kv_heads * 2 == whole.kv_heads and half.block_bytes * 2 == whole.block_bytes


def config_with(heads: int = 4, kv_heads: int = 2, plan: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=64,
        num_hidden_layers=2,
        architectures=["LlamaForCausalLM"],
        base_model_tp_plan={"layers.*.self_attn.q_proj": "colwise"} if plan is None else plan,
    )


@pytest.mark.parametrize(
    "config, quant, recurrent, message",
    [
        (
            config_with(kv_heads=3, heads=6),
            "none",
            False,
            r"must divide the attention heads \(6\) and key/value heads \(3\)",
        ),
        (config_with(plan={}), "none", False, "LlamaForCausalLM has no tensor-parallel plan"),
        (config_with(), "nf4", False, "bitsandbytes weights cannot be sharded"),
        (config_with(), "none", True, "linear-attention layers"),
    ],
)
def test_what_cannot_be_sharded_is_refused(config, quant, recurrent, message):
    with pytest.raises(UserError, match=message):
        tensor_parallel.check_model(config, 2, quant, recurrent)


def test_tp_without_torchrun_is_one_line(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match="torchrun --nproc-per-node 2"):
        tensor_parallel.check_launch(2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UserError, match="launch of 3 processes: start a multiple of 2"):
        tensor_parallel.check_launch(2)
    monkeypatch.setenv("WORLD_SIZE", "4")  # two groups of two: for the modes that split their items
    tensor_parallel.check_launch(2)
    with pytest.raises(UserError, match="makes 2 tensor-parallel groups, which only mode=batch and mode=eval split"):
        tensor_parallel.request(2, "serve")
    try:
        tensor_parallel.request(2, "batch")
    finally:
        tensor_parallel.finish()


def test_in_a_launch_of_several_groups_each_group_s_first_rank_drives(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "0")
    tensor_parallel.request(3, "batch")
    try:
        for rank, follows in ((0, False), (1, True), (2, True), (3, False), (5, True)):
            monkeypatch.setenv("RANK", str(rank))
            assert tensor_parallel.follower() is follows
    finally:
        tensor_parallel.finish()  # (no group was joined: only the request is reset)


@pytest.mark.slow  # suite time; in-process: test_tp_without_torchrun_is_one_line
def test_cli_refuses_tp_without_torchrun_before_loading():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "model.tp=2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model.tp=2 needs one process per shard: torchrun")
    assert "Traceback" not in proc.stderr and "Loading weights" not in proc.stderr


def test_a_follower_zeroes_exactly_the_blocks_rank_0_hands_out(tiny_dir):
    """A follower's pool is never handed blocks itself: it replays rank 0's first-use zeroings (no
    whole-pool zeroing on the first request), so an exposed block it already holds keys in is kept."""
    from pipeline.kv import BlockPool

    config = load_model(str(tiny_dir("llama")), dtype="float32").config
    driver, follower_pool = (BlockPool(config, 8, 4, torch.float32, []) for _ in range(2))
    driver.zeroed, driver.copies = [], []
    first = driver.allocate()
    driver.prepare_write()
    follower_pool.prepare_write()  # allocated like rank 0's; fill with NaN: what fresh memory may hold
    for store in follower_pool.stores:
        store.fill_(float("nan"))
    follower_pool.zero(driver.zeroed)
    for store in follower_pool.stores:
        store[:, :, first] = 1.0  # the first step's keys
    second = driver.allocate()
    driver.copy_block(first, second)
    follower_pool.zero(driver.zeroed)
    for src, dst in driver.copies:
        follower_pool.copy_block(src, dst)
    follower_pool.expose(8)  # attention reads the whole pool: fresh blocks are zeroed, used ones kept
    store = follower_pool.stores[0]
    assert bool((store[:, :, [first, second]] == 1).all())
    assert not bool(store.isnan().any()) and int((store != 0).sum()) == 2 * store[:, :, first].numel()
