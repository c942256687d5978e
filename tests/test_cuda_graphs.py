"""The decode step replayed as CUDA graphs (``pipeline.runner.graphs``), checked on CPU through
the stand-in capture: it records the step's ATen calls once and replays them with their
arguments frozen, as a CUDA graph does, and refuses host reads. So a step that would go wrong
under capture (a shape or value computed on the host, a read of the device) goes wrong here."""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import generate_oracle, submit_all
from pipeline import Pipeline, Request
from pipeline.runner.forward import SingleRowStep, batch_bucket, burst_state, greedy_steps, width_bucket
from pipeline.runner.graphs import GraphedStep, HostRead, cpu_stand_in
from stages import DecodeLoop, Prefill, Sampler


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen2-vl")  # 3-D rope positions: the widest input set a bucket holds


def graphed_pipe(lm, burst: int = 8, capture=cpu_stand_in, **kwargs) -> Pipeline:
    decode = DecodeLoop(**kwargs)
    decode.graphed = GraphedStep(capture=capture) if decode.graphed is not None else None
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": decode}, kv_memory=16 << 20, kv_block_size=4, max_seqs=16)
    pipe.engine.burst = burst
    return pipe


def prompts(lm, sizes: list[int]) -> list[list[int]]:
    words = lm.tokenizer(" ".join(["a picture of shapes"] * 200), add_special_tokens=False)["input_ids"]
    return [words[i : i + n] for i, n in enumerate(sizes)]


# Rows 1..13 cover the batch buckets 1, 2, 4, 8, 16; prompts of 3..37 tokens in 4-token blocks
# over 10 new tokens, the width buckets 2 to 16.
SIZES = [[3], [5, 30], [9, 3, 17], [37, 4, 11, 6, 22], [7] * 8, [3 + 2 * i for i in range(13)]]


@pytest.mark.parametrize("burst", [8, 1])
def test_replayed_buckets_give_eager_tokens(lm, burst):
    graphed, eager = graphed_pipe(lm, burst), graphed_pipe(lm, burst, cuda_graphs=False)
    for sizes in SIZES:
        got = submit_all(graphed, prompts(lm, sizes), 10)
        want = submit_all(eager, prompts(lm, sizes), 10)
        assert [c.generated for c in got] == [c.generated for c in want], sizes
        assert all(c.metrics.info["decode_cuda_graphs"] for c in got)
    step = graphed.stages["decode"].graphed
    assert step.broken is None
    shapes = {(k[0][1], k[3][1]) for k in step.buckets[graphed.pool]}  # (batch, table width)
    assert {b for b, _ in shapes} == {1, 2, 4, 8, 16} and {w for _, w in shapes} >= {4, 8, 16}
    assert all(batch_bucket(b) == b and width_bucket(w) == w for b, w in shapes)
    replays = [bucket.graph.replays for bucket in step.buckets[graphed.pool].values()]
    assert min(replays) >= 1 and sum(replays) > len(replays)  # buckets are reused, not recaptured


def test_one_request_matches_generate(lm):
    ids = prompts(lm, [21])[0]
    ctx = submit_all(graphed_pipe(lm), [ids], 24)[0]
    assert ctx.generated == generate_oracle(lm, torch.tensor([ids]), 24, ignore_eos=True)


def test_sampled_rows_replay_single_steps(lm):
    """Sampled rows take one step at a time, their logits cloned out of the graph's buffer."""
    request = {"sampler": Sampler(temperature=0.8, top_k=20, seed=5)}
    got = submit_all(graphed_pipe(lm), prompts(lm, [4, 13, 25]), 12, **request)
    want = submit_all(graphed_pipe(lm, cuda_graphs=False), prompts(lm, [4, 13, 25]), 12, **request)
    assert [c.generated for c in got] == [c.generated for c in want]


def test_a_step_that_reads_the_host_is_refused_and_decoding_goes_on(lm, monkeypatch, capsys):
    """A step that reads a value back (``.item()``) cannot be captured: said once, then the same
    tokens eagerly."""
    forward = importlib.import_module("pipeline.runner.forward")  # (the package exports a function of that name)

    want = submit_all(graphed_pipe(lm, cuda_graphs=False), prompts(lm, [5, 9]), 6)
    argmax = forward.argmax
    monkeypatch.setattr(forward, "argmax", lambda logits: argmax(logits) + int(logits[0, 0] * 0))
    pipe = graphed_pipe(lm)
    got = submit_all(pipe, prompts(lm, [5, 9]), 6)
    assert [c.generated for c in got] == [c.generated for c in want]
    step = pipe.stages["decode"].graphed
    assert step.broken is not None and "HostRead: aten::item" in step.broken
    err = capsys.readouterr().err
    assert err.count("decode.cuda_graphs: capturing the decode step failed") == 1
    assert not any(c.metrics.info["decode_cuda_graphs"] for c in got)


def test_the_stand_in_catches_a_step_that_counts_on_the_host(lm):
    """``SingleRowStep`` keeps its key count as a Python int (why it is eager-only): captured,
    its replays attend over the capture's keys, and the tokens part from eager decoding's."""
    pipe = graphed_pipe(lm, cuda_graphs=False)
    ids = prompts(lm, [11])[0]
    ctx = pipe.run_ids(ids, Request(max_new_tokens=1, ignore_eos=True))
    start, fed, pool = len(ids), ctx.generated[-1], pipe.pool
    ctx.cache.reserve(6)  # blocks for the six positions decoded below
    state = burst_state(pool, [fed], [[start]] * 3, [start], [list(ctx.cache.blocks)], 6, lm.device)
    with torch.inference_mode():
        pool.prepare_write()
        eager = [int(t) for t in torch.cat(greedy_steps(lm.model, pool, state, 6))[:, 0]]
        step, inputs = SingleRowStep(start + 1, None), [t.clone() for t in state]

        def once() -> torch.Tensor:
            chosen, positions, lengths = step(lm.model, pool, *inputs)
            inputs[0].copy_(chosen), inputs[1].copy_(positions), inputs[2].copy_(lengths)
            return chosen

        graph, _ = cpu_stand_in(once, None)
        for t, s in zip(inputs, state):
            t.copy_(s)
        replayed = []
        for _ in range(6):
            graph.replay()
            replayed.append(int(inputs[0][0, 0]))
    assert replayed != eager


def test_hooks_keep_decoding_eager(lm, capsys):
    handle = lm.model.get_decoder().layers[0].register_forward_hook(lambda *a: None)
    try:
        pipe = graphed_pipe(lm)
        got = submit_all(pipe, prompts(lm, [5]), 4)
    finally:
        handle.remove()
    assert not got[0].metrics.info["decode_cuda_graphs"]
    assert "decode.cuda_graphs: forward hooks on model.language_model.layers.0" in capsys.readouterr().err


def test_host_reads_are_refused_by_the_stand_in():
    x = torch.arange(4.0)
    with pytest.raises(HostRead, match="_local_scalar_dense"):
        cpu_stand_in(lambda: x * float(x.sum()), None)
    with pytest.raises(HostRead, match="aten::index"):  # a boolean mask's indices are its nonzero()
        cpu_stand_in(lambda: x[x > 1], None)


def test_cpu_decoding_ignores_the_cuda_graph_setting(lm, capsys):
    """The default (``decode.cuda_graphs=true``) on CPU: the runner leaves the step out, silently."""
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=8 << 20)
    assert pipe.stages["decode"].graphed is not None and pipe.engine.runner.compiled is None
    ctx = submit_all(pipe, prompts(lm, [7]), 5)[0]
    assert not ctx.metrics.info["decode_cuda_graphs"] and "cuda_graphs" not in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_cuda_graphs_on_cuda_give_eager_tokens(lm, attention):
    """The real capture (``torch.cuda.CUDAGraph``) at every bucket mixed batches reach, greedy
    bursts and single steps: eager decoding's tokens, and every bucket captured once."""

    def pipe(graphs: bool, burst: int) -> Pipeline:
        p = Pipeline(
            lm,
            {"prefill": Prefill(), "decode": DecodeLoop(cuda_graphs=graphs)},
            kv_memory=16 << 20,
            kv_block_size=4,
            max_seqs=16,
            kv_attention=attention,
        )
        p.engine.burst = burst
        return p

    for burst in (8, 1):
        graphed, eager = pipe(True, burst), pipe(False, burst)
        for sizes in SIZES if attention == "sdpa" else SIZES[:3]:  # flex: a Triton compile per batch bucket
            got = submit_all(graphed, prompts(lm, sizes), 10)
            want = submit_all(eager, prompts(lm, sizes), 10)
            assert [c.generated for c in got] == [c.generated for c in want], (burst, sizes)
            assert all(c.metrics.info["decode_cuda_graphs"] for c in got)
        step = graphed.stages["decode"].graphed
        assert step.broken is None and len(step.buckets[graphed.pool]) >= 3
