"""The native CPU decode attention (pipeline/runner/decode_attention.cpp): the numbers of SDPA
over gathered keys, and the engine's decode rows on it (eager and compiled) give generate()'s
tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import generate_oracle, kernel_calls, submit_all
from pipeline import Pipeline, load_model
from pipeline.runner import attention, matvec
from stages import DecodeLoop, Prefill

pytestmark = [
    pytest.mark.skipif(matvec.load() is not None, reason=f"native kernels unavailable: {matvec.load()}"),
    pytest.mark.usefixtures("split_threads"),  # the kernel splits (row, head) tasks between threads
]


def reference(q, k, v, slots, mask, scale):
    """SDPA in float64 over the gathered keys: [rows, heads, dim]."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    ks, vs = (t[slots].transpose(1, 2).double() for t in (k, v))  # [rows, kv_heads, keys, dim]
    o = F.scaled_dot_product_attention(
        q.double().view(rows, kv_heads, heads // kv_heads, dim),
        ks,
        vs,
        attn_mask=None if mask is None else mask.view(rows, 1, 1, -1),
        scale=scale,
    )
    return o.reshape(rows, heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(16, 4, 64), (12, 2, 128), (8, 8, 80), (14, 2, 64), (16, 2, 64), (10, 2, 72)]
)  # 72: eight columns left after the 16-column blocks
def test_it_equals_sdpa_over_gathered_keys(dtype, heads, kv_heads, dim):
    torch.manual_seed(0)
    rows, slots_in_pool, keys = 5, 300, 37
    q = torch.randn(rows, heads, dim).to(dtype)
    k, v = (torch.randn(slots_in_pool, kv_heads, dim).to(dtype) for _ in range(2))
    slots = torch.randint(0, slots_in_pool, (rows, keys))
    seen = torch.arange(keys) < torch.tensor([1, 5, 37, 20, 36]).unsqueeze(1)  # row 0 sees one key
    for mask in (seen.view(rows, 1, 1, keys), None):
        got = torch.ops.mm_pipeline.decode_attention(q, k, v, slots, mask, 0.125)
        want = reference(q, k, v, slots, mask, 0.125)
        assert got.dtype == dtype and got.shape == (rows, heads, dim)
        # float32: the order of the sums; bfloat16: inputs as stored, one rounding of the output
        tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_padded_in_a_batch(dtype):
    """A decode row's answer must not depend on its batch: alone its keys are exactly its own, in a
    batch they are padded (masked) to the longest row's or the step's bucket."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, 64).to(dtype)
    k, v = (torch.randn(400, 2, 64).to(dtype) for _ in range(2))
    for keys in (1, 7, 8, 9, 15, 17, 31, 33, 64, 70, 129):
        slots = torch.randperm(400)[:keys].unsqueeze(0)
        alone = torch.ops.mm_pipeline.decode_attention(q, k, v, slots, None, 0.125)
        for pad in (1, 5, 16, 40):
            padded = torch.cat([slots, torch.zeros(1, pad, dtype=torch.long)], dim=1)
            mask = torch.arange(keys + pad).unsqueeze(0) < keys
            batched = torch.ops.mm_pipeline.decode_attention(q, k, v, padded, mask, 0.125)
            assert torch.equal(batched, alone), (keys, pad)


def test_masked_keys_are_never_read_and_a_strided_query_is_taken():
    torch.manual_seed(0)
    q = torch.randn(3, 2, 4, 16).transpose(1, 2)[:, :, 0]  # [3 rows, 4 heads, 16]: not contiguous
    k, v = torch.randn(50, 2, 16), torch.randn(50, 2, 16)
    k[40:] = float("nan")  # slots only masked positions name
    v[40:] = float("nan")
    slots = torch.tensor([[1, 2, 45, 46], [3, 4, 5, 47], [6, 7, 8, 9]])
    mask = torch.tensor([[True, True, False, False], [True, True, True, False], [True, True, True, True]])
    got = torch.ops.mm_pipeline.decode_attention(q, k, v, slots, mask, 0.25)
    assert not got.isnan().any()
    fine = slots.clamp(max=39)
    torch.testing.assert_close(got.double(), reference(q, k, v, fine, mask, 0.25), atol=2e-6, rtol=2e-6)


def test_shapes_it_does_not_take_are_refused_in_one_message():
    q, k = torch.randn(2, 36, 64), torch.randn(10, 2, 64)  # 18 query heads per key/value head
    with pytest.raises(RuntimeError, match="at most 8 query heads per key/value head"):
        torch.ops.mm_pipeline.decode_attention(q, k, k, torch.zeros(2, 3, dtype=torch.long), None, 1.0)
    with pytest.raises(RuntimeError, match="slot 10 outside the pool"):  # never a read past the pool
        torch.ops.mm_pipeline.decode_attention(q[:, :16], k, k, torch.tensor([[0, 10], [1, 2]]), None, 1.0)
    kv = attention.LayerKV(k, k)
    with matvec.active():
        assert not attention.native_decode(q.unsqueeze(2), kv)  # the engine keeps SDPA for such a model
        assert attention.native_decode(torch.randn(2, 16, 1, 64), kv)


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """Every linear wrapped: the tiny models' matrices are below the size the native kernels take,
    and without a wrapped linear the engine's native kernels stay off (``ModelRunner.native``)."""
    monkeypatch.setattr(matvec, "MIN_ELEMENTS", 0)


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])  # gemma3: sliding-window layers (their mask)
def test_engine_decode_rows_on_it_match_generate(tiny_dir, family):
    lm = load_model(str(tiny_dir(family)), dtype="float32")
    pipe = Pipeline(lm, {"prefill": Prefill(), "decode": DecodeLoop()})
    vocab = lm.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 19, 40)]
    got, calls = kernel_calls(lambda: submit_all(pipe, prompts, 12))
    assert calls > 0
    for ids, c in zip(prompts, got):
        assert list(c.generated) == generate_oracle(lm, torch.tensor([ids]), 12, ignore_eos=True)


# The compiled step on it (and on packed weights): tests/test_packed.py, one compile for both.


@pytest.mark.parametrize("heads,kv_heads,dim", [(20, 4, 64), (8, 8, 64), (4, 2, 320)])  # 320: pack_gqa's form
def test_rows_as_alone_gives_each_row_the_bits_of_generates_call(heads, kv_heads, dim):
    """Each row over exactly the keys its mask shows, by transformers' SDPA call for one unpadded
    row (generate()'s), bit for bit in bfloat16: keys read in place (consecutive slots) or
    gathered, padded and masked in a batch or not."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    pool_k, pool_v = (torch.randn(400, kv_heads, dim).to(torch.bfloat16) for _ in range(2))
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    lengths = [1, 37, 130]
    slots = torch.stack([torch.arange(100, 230), torch.randperm(400)[:130], torch.arange(0, 130)])
    q = torch.randn(3, heads, dim).to(torch.bfloat16)
    mask = (torch.arange(130) < torch.tensor(lengths).unsqueeze(1)).view(3, 1, 1, 130)
    got = torch.ops.mm_pipeline.rows_as_alone(q, pool_k, pool_v, slots, mask, 0.125)
    for b, n in enumerate(lengths):
        keys, values = (p[slots[b, :n]].transpose(0, 1).unsqueeze(0) for p in (pool_k, pool_v))
        want = sdpa_attention_forward(module, q[b].view(1, heads, 1, dim), keys, values, None, scaling=0.125)[0]
        assert torch.equal(got[b], want[0, 0]), b
    alone = torch.ops.mm_pipeline.rows_as_alone(q[1:2], pool_k, pool_v, slots[1:2, :37], None, 0.125)
    assert torch.equal(alone, got[1:2])
