"""The GPU path's first run, checked on CPU through the same code (issue 26): KV pools sized
together and with room for activations (a simulated free CUDA memory), a sweep that frees each
job, ``quant=auto`` choosing by the weights' size (a simulated GPU), and ``decode.compile``
under a scheme that cannot compile saying so in one line."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

import pipeline.__main__ as entry
import pipeline.modes.bench as bench
from pipeline import Pipeline, Request, UserError, load_model
from pipeline.engine import headroom
from pipeline.model import loading
from pipeline.kv import sizing
from pipeline.spec import Speculative
from pipeline.runner import ModelRunner, matvec
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

MiB = 1 << 20


class FakeMeter:
    """CUDA's allocator statistics, simulated: a warm-up peaks at what the test says."""

    def __init__(self, peak: int) -> None:
        self.device, self._peak, self.started = torch.device("cpu"), peak, 0

    def start(self) -> None:
        self.started += 1

    def held(self) -> int:
        return 0

    def peak(self) -> int:
        return self._peak


@pytest.fixture
def cuda_free(monkeypatch):
    """Pools sized as on a GPU with ``free["bytes"]`` free: the device the pool is judged on reads
    as cuda:0, its free memory as given, and a warm-up's measured peak as ``free["peak"]`` (the
    pools themselves stay where the layers are)."""
    free = {"bytes": 64 * MiB, "peak": 4 * MiB, "meters": []}

    def meter(device):
        free["meters"].append(FakeMeter(free["peak"]))
        return free["meters"][-1]

    monkeypatch.setattr(sizing, "pool_device", lambda lm: torch.device("cuda", 0))
    monkeypatch.setattr(sizing, "free_bytes", lambda device, lm: (free["bytes"], "simulated free on cuda:0"))
    monkeypatch.setattr(headroom, "meter_for", meter)
    return free


def held_bytes(pool) -> int:
    """Bytes of the blocks a pool hands out (the null block is not one)."""
    return (pool.num_blocks - 1) * pool.block_bytes


# --- pools sized together --------------------------------------------------------------------


def test_target_and_draft_pools_share_one_budget(tiny_dir, load_tiny, cuda_free):
    """Sized one after the other, target and draft each took 80% of the same free memory; from
    one budget they fit in it together, holding the same number of tokens each."""
    lm = load_model(str(tiny_dir("qwen3")), dtype=torch.float32)  # its own: no pool shared with other tests
    draft = load_tiny("qwen3", dtype=torch.float64)  # twice the KV bytes per token: the split follows them
    spec = Speculative("draft", num_draft=3, draft=draft)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(speculative=spec)}, max_batch_tokens=256)
    pools = pipe.pools
    target, drafted = pools.pools
    budget = pools.budget
    assert budget.nbytes == int(0.8 * (cuda_free["bytes"] - budget.reserved))
    assert held_bytes(target) + held_bytes(drafted) <= budget.nbytes
    assert held_bytes(target) + held_bytes(drafted) > 0.99 * budget.nbytes - target.block_bytes - drafted.block_bytes
    assert abs(target.capacity_tokens - drafted.capacity_tokens) <= target.block_size
    assert drafted.block_bytes == 2 * target.block_bytes
    result = pipe.run_ids(list(range(5, 25)), Request(max_new_tokens=6, ignore_eos=True))
    assert len(result.generated) == 6 and drafted.lookups > 0  # the draft drafted in its share


def test_a_draft_with_its_own_memory_setting_sizes_its_own_pool(tiny_dir, load_tiny, cuda_free):
    lm = load_model(str(tiny_dir("qwen3")), dtype=torch.float32)
    spec = Speculative("draft", draft=load_tiny("qwen3"), draft_memory=1 * MiB)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop(speculative=spec)}, max_batch_tokens=256)
    assert not spec.shares_budget and len(pipe.pools.pools) == 1  # not joined: sized on first use, as asked
    pipe.run_ids(list(range(5, 25)), Request(max_new_tokens=4, ignore_eos=True))
    assert spec.pool is None


# --- memory kept for activations --------------------------------------------------------------


def test_auto_keeps_room_for_a_full_prefill_and_the_largest_image(load_tiny, cuda_free):
    """kv.memory=auto on a GPU: 80% of what is free once a max_batch_tokens prefill and the
    vision encoder's largest input are kept free; a larger token budget leaves a smaller pool,
    and the pool line says how much was kept and why."""
    vl = load_tiny("qwen2-vl")
    cuda_free["bytes"] = 2048 * MiB
    small = sizing.pools_for([vl], "auto", max_batch_tokens=512, max_seqs=8)
    large = sizing.pools_for([vl], "auto", max_batch_tokens=4096, max_seqs=8)
    for pools in (small, large):
        reserved = pools.budget.reserved
        assert reserved == sizing.activation_headroom(vl, 4096 if pools is large else 512, 8)[0] > 0
        assert held_bytes(pools.pools[0]) <= 0.8 * (2048 * MiB - reserved)
    assert large.budget.reserved > small.budget.reserved
    assert large.pools[0].capacity_tokens < small.pools[0].capacity_tokens
    line = large.describe()
    assert "for activations" in line and "4,096-token prefill" in line and "largest image" in line
    assert sizing.largest_image_patches(vl) > 0


def test_auto_is_sized_after_a_warm_up_of_the_largest_steps(tiny_dir, cuda_free, monkeypatch):
    """A pipeline's kv.memory=auto on a GPU: before the pool is sized, a scratch copy of the chain
    runs the largest image, a lone max_batch_tokens prompt and max_seqs prompts packed into one
    step; what the device peaked at (simulated), with a margin, is kept free. The scratch pool is
    gone afterwards and the real one serves requests."""
    vl = load_model(str(tiny_dir("qwen2-vl")), dtype=torch.float32)  # its own: no pool shared with other tests
    cuda_free.update(bytes=512 * MiB, peak=40 * MiB)
    steps, pixels, scratch_pools = [], [], []
    forward, encode, scratch = ModelRunner.forward, vl.family.encode_images, Pipeline.scratch
    monkeypatch.setattr(
        ModelRunner, "forward", lambda self, chunks: steps.append([c.count for c in chunks]) or forward(self, chunks)
    )
    monkeypatch.setattr(
        vl.family,
        "encode_images",
        lambda ctx, todo: (
            pixels.append(sum(int(t.prod()) for t in ctx.model_inputs["image_grid_thw"])) or encode(ctx, todo)
        ),
    )
    monkeypatch.setattr(
        Pipeline, "scratch", lambda self, nbytes: scratch_pools.append(scratch(self, nbytes)) or scratch_pools[-1]
    )
    pipe = Pipeline(
        vl,
        {"tokenize": Tokenize(), "vision": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()},
        max_batch_tokens=256,
        max_seqs=4,
    )
    pools = pipe.pools
    assert cuda_free["meters"][0].started == 1
    assert pools.budget.reserved == int(40 * MiB * headroom.MARGIN)
    assert pools.budget.nbytes == int(0.8 * (512 * MiB - pools.budget.reserved))
    assert (
        "for activations: a 256-token prefill and the largest image peaked at 40.00 MiB in a warm-up"
        in pools.describe()
    )
    assert pixels == [sizing.largest_image_patches(vl)]  # the encoder saw the processor's largest image
    assert [256] in steps and [64, 64, 64, 64] in steps  # a lone full step, and max_seqs chunks filling one
    pool = weakref.ref(scratch_pools.pop().pool)
    gc.collect()
    assert pool() is None and pipe.pool is pools.pools[0]
    assert len(pipe.run_ids(list(range(5, 25)), Request(max_new_tokens=4, ignore_eos=True)).generated) == 4


def test_a_warm_up_that_runs_out_of_memory_is_one_line(tiny_dir, cuda_free, monkeypatch):
    lm = load_model(str(tiny_dir("qwen3")), dtype=torch.float32)

    def oom(self, chunks):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(ModelRunner, "forward", oom)
    with pytest.raises(UserError, match="warm-up .* ran out of it .* lower engine.max_batch_tokens") as err:
        Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}).pools
    assert "\n" not in str(err.value)


def test_a_set_kv_memory_runs_no_warm_up(tiny_dir, cuda_free):
    lm = load_model(str(tiny_dir("qwen3")), dtype=torch.float32)
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=0.5)
    assert pipe.pools.budget.reserved == 0 and cuda_free["meters"] == []


def test_auto_that_leaves_no_room_after_the_headroom_is_one_line(load_tiny, cuda_free):
    lm = load_tiny("qwen3")
    reserved, _ = sizing.activation_headroom(lm, 2048, 8)
    cuda_free["bytes"] = reserved + 100  # the activations take it all
    with pytest.raises(UserError, match="after keeping .* for activations") as err:
        sizing.pool_for(lm, "auto")
    assert "\n" not in str(err.value)


def test_cpu_auto_keeps_its_rule(load_tiny, monkeypatch):
    """On CPU nothing is kept aside (pages are touched only as blocks are used)."""
    monkeypatch.setattr(sizing, "free_bytes", lambda device, lm: (64 * MiB, "available RAM"))
    pools = sizing.pools_for([load_tiny("qwen3")], "auto")
    assert pools.budget.reserved == 0 and pools.budget.nbytes == 16 * MiB


def test_cpu_auto_gives_the_same_pool_when_free_ram_moves_a_little(load_tiny, monkeypatch):
    """Two runs a few hundred MiB of free RAM apart get the same pool (a step of 256 MiB), so the
    second finds the first one's compiled decode step (its graphs have the pool's shape); the
    cap is unchanged."""
    free = {"bytes": 0}
    monkeypatch.setattr(sizing, "free_bytes", lambda device, lm: (free["bytes"], "available RAM"))
    lm = load_tiny("qwen3")

    def pool_bytes(gib: float) -> int:
        free["bytes"] = int(gib * 1024 * MiB)
        return sizing.pools_for([lm], "auto").budget.nbytes

    assert pool_bytes(6.1) == pool_bytes(6.9) == 1536 * MiB
    assert pool_bytes(5.9) == 1280 * MiB and pool_bytes(12) == pool_bytes(40) == 2048 * MiB


# --- a sweep frees each job -------------------------------------------------------------------


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_sweep_frees_each_job_before_the_next(monkeypatch, tmp_path):
    """Three bench jobs of one multirun in this process: each job's model is gone once the job
    ends (nothing but the cycle collector would free it), and resident memory stays flat."""
    models, after = [], []
    load = bench.load_from_cfg
    release = entry.release_job

    def loading_job(cfg):
        lm = load(cfg)
        models.append(weakref.ref(lm.model))
        return lm

    def released() -> None:
        release()
        after.append((resident_bytes(), [ref() is None for ref in models]))

    monkeypatch.setattr(bench, "load_from_cfg", loading_job)
    monkeypatch.setattr(entry, "release_job", released)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "pipeline",
            "-m",
            "mode=bench",
            "bench.seed=0,1,2",
            "bench.prompt_lengths=[8]",
            "bench.gen_lengths=[4]",
            "bench.repetitions=1",
            "bench.warmup=0",
            f"hydra.sweep.dir={tmp_path}",
        ],
    )
    try:
        entry.hydra_main()
    finally:
        GlobalHydra.instance().clear()
        gc.unfreeze()  # (each job froze this process's heap: ``settle_imports``)
    assert [gone for _, gone in after] == [[True], [True, True], [True, True, True]]
    assert abs(after[2][0] - after[0][0]) <= 0.1 * after[0][0]
    assert all((tmp_path / str(job) / "bench.json").is_file() for job in range(3))


# --- quant=auto by the weights' size ----------------------------------------------------------


@pytest.fixture
def real_model(held_out_dir):
    """A tiny model that reads as a real one (no project marker): quant=auto judges its size."""
    return str(held_out_dir("qwen3"))


def on_gpu_of(monkeypatch, total: int) -> None:
    monkeypatch.setattr(loading, "accelerator_memory", lambda device_map, budgets: ("cuda:0", total))


def test_auto_keeps_16_bit_weights_that_fit_in_half_the_gpu(real_model, monkeypatch):
    weights = loading.estimated_weights_bytes(real_model, loading.read_config(real_model), torch.float32)
    on_gpu_of(monkeypatch, 2 * weights + 1)
    lm = load_model(real_model, dtype=torch.float32, quant="auto")
    assert lm.quant == "none"
    assert (
        lm.quant_note.startswith("quant=auto kept float32: the weights") and "at most half of cuda:0" in lm.quant_note
    )


def test_auto_picks_nf4_for_weights_over_half_the_gpu(real_model, monkeypatch):
    weights = loading.estimated_weights_bytes(real_model, loading.read_config(real_model), torch.float32)
    on_gpu_of(monkeypatch, weights)  # the weights would take all of it
    lm = load_model(real_model, dtype=torch.float32, quant="auto")
    assert lm.quant == "nf4"
    assert lm.quant_note.startswith("quant=auto chose nf4") and "more than half of cuda:0" in lm.quant_note


@pytest.mark.parametrize("scheme", ["int8wo", "int4wo", "nf4"])
def test_quantised_weights_load_onto_the_gpu(real_model, monkeypatch, scheme):
    """On a GPU machine a quantised model is loaded onto the GPU: torchao quantises weights where
    they are, and left on the CPU its int4 packing failed to load (seen on an H100) and int8
    would have decoded on the CPU. A simulated GPU; the load is stopped where transformers starts."""
    import transformers

    seen = {}

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        raise OSError("stopped here by the test")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(UserError, match="stopped here by the test"):
        load_model(real_model, dtype=torch.bfloat16, quant=scheme)
    assert seen["device_map"] == {"": 0} and seen["quantization_config"] is not None


def test_weights_are_estimated_from_the_checkpoint_before_loading(real_model, load_tiny):
    """The estimate (safetensors bytes rescaled to the load dtype) is what the loaded model holds."""
    config = loading.read_config(real_model)
    loaded = load_tiny("qwen3").weights_bytes
    assert abs(loading.estimated_weights_bytes(real_model, config, torch.float32) - loaded) < 0.01 * loaded
    assert loading.estimated_weights_bytes(real_model, config, torch.bfloat16) * 2 == pytest.approx(loaded, rel=0.01)


@pytest.mark.skipif(matvec.load() is not None, reason="no native kernel on this machine")
def test_auto_on_cpu_picks_int8wo_which_decodes_like_generate(real_model, monkeypatch):
    from conftest import generate_oracle

    lm = load_model(real_model, dtype=torch.float32, quant="auto", device_map="cpu")
    assert lm.quant == "int8wo" and lm.quant_note.startswith("quant=auto chose int8wo on CPU")
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()})
    ctx = pipe.run_ids(list(range(5, 25)), Request(max_new_tokens=10, ignore_eos=True))
    assert list(ctx.generated) == generate_oracle(lm, torch.tensor([list(range(5, 25))]), 10, ignore_eos=True)


def test_auto_on_cpu_without_the_kernel_and_for_project_models_says_why(real_model, tiny_dir, monkeypatch):
    monkeypatch.setattr(matvec, "load", lambda: "the CPU has no AVX2 (DEFAULT)")
    assert loading.auto_scheme(real_model, loading.read_config(real_model), torch.float32, "cpu", {}) == (
        "none",
        "quant=auto: none on CPU (no native kernel: the CPU has no AVX2 (DEFAULT); int8 would dequantise "
        "in every matmul)",
    )
    assert (
        loading.auto_scheme(
            str(tiny_dir("qwen3")), loading.read_config(str(tiny_dir("qwen3"))), torch.float32, None, {}
        )[1]
        == "quant=auto: none for a model built by this project"
    )


# --- decode.compile under a scheme that cannot compile -------------------------------------------


def test_compile_under_nf4_says_so_in_one_line(load_tiny, capsys):
    lm4 = load_tiny("qwen3", quant="nf4")
    pipe = Pipeline(lm4, {"prefill": Prefill(), "decode": DecodeLoop(compile=True)}, kv_memory=1 * MiB)
    for _ in range(2):
        pipe.run_ids(list(range(5, 15)), Request(max_new_tokens=4, ignore_eos=True))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "decode.compile" in line]
    assert len(lines) == 1 and lines[0].startswith("mm-pipeline: decode.compile: nf4 ")
    assert lines[0].endswith("; decoding uncompiled") and "warn" not in err and "FastPathFallback" not in err


def test_gpu_memory_is_what_the_map_uses_capped_by_max_memory(monkeypatch):
    """The memory quant=auto halves: the GPUs the weights would load into, each capped by its
    model.max_memory budget (a simulated pair of 80 GiB GPUs)."""
    from types import SimpleNamespace

    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GiB))
    assert loading.accelerator_memory(None, {}) == ("cuda:0", 80 * GiB)
    assert loading.accelerator_memory("cuda:1", {}) == ("cuda:1", 80 * GiB)
    assert loading.accelerator_memory("auto", {1: 10 * GiB}) == ("cuda:0, cuda:1", 90 * GiB)
    assert loading.accelerator_memory({"model": 0, "lm_head": "cpu"}, {0: 20 * GiB}) == ("cuda:0", 20 * GiB)
    assert loading.accelerator_memory("cpu", {}) is None
