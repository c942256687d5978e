"""LoRA adapters: each request's adapter, alone or batched with others, answers as peft's merged
model does under generate(); the prefix cache never shares KV across adapters; bad adapters are
refused in one line. Adapters are made with peft on held-out models (saved with save_pretrained,
random non-zero A and B)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import image_chat_inputs, run_cli
from pipeline import Pipeline, Request
from pipeline.errors import UserError
from pipeline.frontends.chat_session import ChatSession
from pipeline.model.loading import load_model
from pipeline.spec import Speculative
from pipeline.testing.lora import make_adapter, merged_model, peft_model
from stages import AudioEncoder, DecodeLoop, Prefill, Sampler, Tokenize, VisionEncoder

N = 12
PROMPT = "Tell me about the sea."


@pytest.fixture(scope="module")
def made(held_out_dir, tmp_path_factory):
    """made(family, name) -> (base dir, adapter dir): adapters made once per module."""
    base = tmp_path_factory.mktemp("adapters")
    specs = {
        "a": dict(seed=1),
        "b": dict(seed=2, targets="all-linear", r=8, alpha=16, use_rslora=True),
        "c": dict(seed=3, r=6, rank_pattern={"layers.0.self_attn.q_proj": 2}, alpha_pattern={"down_proj": 3}),
        "vision": dict(seed=4, targets=["q_proj", "v_proj", "qkv"]),
    }
    cache: dict = {}

    def get(family: str, name: str):
        if (family, name) not in cache:
            base_dir = held_out_dir(family)
            cache[family, name] = base_dir, make_adapter(base_dir, base / f"{family}-{name}", **specs[name])
        return cache[family, name]

    return get


def pipe_for(lm, spec=None, **engine) -> Pipeline:
    stages = {"tokenize": Tokenize()}
    if set(lm.family.media) & {"image", "video"}:
        stages["vision_encoder"] = VisionEncoder()
    if "audio" in lm.family.media:
        stages["audio_encoder"] = AudioEncoder()
    stages.update(prefill=Prefill(), decode=DecodeLoop(Sampler(), speculative=spec))
    return Pipeline(lm, stages, **engine)


def loaded(base_dir, adapters: dict, **load):
    lm = load_model(str(base_dir), **{"dtype": torch.float32, "quant": "none", **load})
    for name, path in adapters.items():
        lm.load_adapter(name, str(path))
    return lm


def chat_ids(lm, prompt: str = PROMPT) -> torch.Tensor:
    return lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def greedy(model, ids: torch.Tensor, n: int = N, **inputs) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **inputs
        )
    return out[0, ids.shape[1] :].tolist()


def request(adapter=None, prompt=PROMPT, **fields) -> Request:
    return Request(prompt=prompt, max_new_tokens=N, adapter=adapter, **fields)


@pytest.fixture(scope="module")
def qwen3(made):
    """The held-out Qwen3 with adapters a, b, c loaded, and each one's merged-model answer."""
    dirs = {name: made("qwen3", name)[1] for name in "abc"}
    base_dir = made("qwen3", "a")[0]
    lm = loaded(base_dir, dirs)
    ids = chat_ids(lm)
    want = {None: greedy(lm.model, ids)}
    want.update({name: greedy(merged_model(base_dir, path), ids) for name, path in dirs.items()})
    return lm, want


def test_each_adapter_alone_equals_generate_on_peft_merged_model(qwen3):
    lm, want = qwen3
    pipe = pipe_for(lm)
    assert len({tuple(v) for v in want.values()}) == 4  # every adapter changes the answer
    for name, tokens in want.items():
        assert pipe.run(request(name)).token_ids == tokens


def test_adapters_and_base_batched_together_each_get_their_own_answer(qwen3):
    lm, want = qwen3
    pipe = pipe_for(lm, burst=1)
    names = [None, "a", "b", "c", "a", None, "b"]
    handles = [pipe.submit(request(name)) for name in names]  # one step holds rows of three adapters and none
    assert [h.result().token_ids for h in handles] == [want[name] for name in names]
    bursting = pipe_for(lm)  # greedy decode bursts over rows of several adapters
    handles = [bursting.submit(request(name)) for name in ("a", "b")]
    assert [h.result().token_ids for h in handles] == [want["a"], want["b"]]


def test_preempted_and_chunked_adapter_rows_recompute_under_their_adapter(qwen3):
    from pipeline.memory import kv_bytes

    lm, want = qwen3
    tight = kv_bytes(lm.config, 16, lm.model.dtype) * 12  # 12 blocks for 16 sequences: preemptions
    pipe = pipe_for(lm, kv_memory=tight, max_seqs=16, max_batch_tokens=48)  # prompts prefill in chunks
    names = [None, "a", "b", "c"] * 4
    before = pipe.engine.counters["preemptions"]
    handles = [pipe.submit(request(name)) for name in names]
    assert [h.result().token_ids for h in handles] == [want[name] for name in names]
    assert pipe.engine.counters["preemptions"] > before, "the pool was meant to force preemption"


def test_the_engine_names_the_adapters_running_and_waiting(qwen3):
    lm, want = qwen3
    pipe = pipe_for(lm, max_seqs=1)
    handles = [pipe.submit(request(name)) for name in ("b", None, "a")]
    assert pipe.engine.adapters_in_flight() == ([], ["a", "b"])
    with torch.inference_mode():
        pipe.engine.step()  # admits the first (one at a time)
    assert pipe.engine.adapters_in_flight() == (["b"], ["a"])
    assert [h.result().token_ids for h in handles] == [want["b"], want[None], want["a"]]
    assert pipe.engine.adapters_in_flight() == ([], [])


def test_prefix_cache_is_keyed_by_adapter(qwen3):
    lm, want = qwen3
    pipe = pipe_for(lm)
    long = "Describe the sea, the waves, the wind and the sky over the water " * 3
    first = pipe.run(request("a", long))
    assert first.metrics["kv_reused_tokens"] == 0
    assert pipe.run(request("b", long)).metrics["kv_reused_tokens"] == 0  # other adapter: nothing shared
    assert pipe.run(request(None, long)).metrics["kv_reused_tokens"] == 0  # nor the base
    again = pipe.run(request("a", long))
    assert again.metrics["kv_reused_tokens"] > 0 and again.token_ids == first.token_ids


def test_a_conversation_switching_adapters_recomputes_under_the_new_one(qwen3):
    lm, want = qwen3
    session = ChatSession(pipe_for(lm), max_new_tokens=N)
    session.use_adapter("a")
    assert session.send(PROMPT).token_ids == want["a"]
    session.undo()
    session.use_adapter("b")  # the cache holds a's keys: dropped, recomputed under b
    assert session.send(PROMPT).token_ids == want["b"]
    with pytest.raises(UserError, match="no adapter named 'zzz' is loaded"):
        session.use_adapter("zzz")


def test_chat_adapter_command_switches_the_answering_adapter(qwen3):
    import io

    from pipeline.modes.chat import Repl

    lm, want = qwen3
    chat = ChatSession(pipe_for(lm), max_new_tokens=N)
    out, err = io.StringIO(), io.StringIO()
    script = f"/adapter\n/adapter zzz\n/adapter b\n{PROMPT}\n/undo\n/adapter none\n{PROMPT}\n"
    Repl(chat, stdin=io.StringIO(script), stdout=out, stderr=err, stream=False).loop()
    notes = err.getvalue()
    assert "answering with: the base model; adapters loaded: a, b, c" in notes
    assert "error: no adapter named 'zzz' is loaded (loaded: a, b, c)" in notes
    assert "[answering with b from the next message]" in notes
    assert out.getvalue().startswith(lm.tokenizer.decode(want["b"], skip_special_tokens=True))
    assert chat.last.token_ids == want[None] and chat.adapter is None


def test_unloading_lets_running_requests_finish_and_refuses_new_ones(made):
    base_dir, path = made("qwen3", "a")
    lm = loaded(base_dir, {"a": path})
    pipe = pipe_for(lm)
    want = pipe.run(request("a")).token_ids
    handle = pipe.submit(request("a"))
    pipe.unload_adapter("a")
    assert handle.result().token_ids == want
    with pytest.raises(UserError, match="no adapter named 'a' is loaded"):
        pipe.submit(request("a"))
    pipe.load_adapter("a", str(path))  # loaded again under the same name: the same answers
    assert pipe.run(request("a")).token_ids == want


def test_speculative_decoding_with_an_adapter_keeps_the_merged_models_tokens(qwen3):
    lm, want = qwen3
    for spec in (Speculative("ngram", num_draft=4), Speculative("draft", num_draft=3, draft=lm)):
        pipe = pipe_for(lm, spec)  # the draft is the base model: its drafts are verified under the adapter
        handles = [pipe.submit(request(name)) for name in ("a", None, "b")]
        assert [h.result().token_ids for h in handles] == [want["a"], want[None], want["b"]]


def test_logprobs_with_an_adapter_are_the_merged_models(qwen3, made):
    lm, _ = qwen3
    base_dir, path = made("qwen3", "b")
    result = pipe_for(lm).run(request("b", logprobs=2))
    ids = result.prompt_ids + result.token_ids
    with torch.inference_mode():
        logits = merged_model(base_dir, path)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    start = len(result.prompt_ids)
    got = torch.tensor([e.logprob for e in result.logprobs])
    want = logits[start - 1 : -1].gather(1, torch.tensor(result.token_ids).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_structured_output_with_an_adapter(qwen3):
    lm, _ = qwen3
    pipe = pipe_for(lm)
    handles = [pipe.submit(request(name, choice=["yes", "no", "maybe"])) for name in ("a", "b", None)]
    assert all(h.result().text in ("yes", "no", "maybe") for h in handles)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = pipe.run(Request(prompt=PROMPT, max_new_tokens=40, adapter="c", json_schema=schema))
    assert isinstance(json.loads(out.text)["n"], int)


@pytest.mark.parametrize(
    "load", [dict(quant="int8wo"), dict(quant="nf4"), dict(dtype=torch.bfloat16)], ids=["int8wo", "nf4", "bfloat16"]
)
def test_quantised_or_16_bit_weights_with_an_adapter_answer_as_peft_on_the_same_weights(made, load):
    base_dir, path = made("qwen3", "b")
    lm = loaded(base_dir, {"b": path}, **load)
    assert lm.quant == load.get("quant", "none")
    ids = chat_ids(lm)
    want = greedy(peft_model(base_dir, path, **load), ids)  # peft's own layers on the same weights
    assert want != greedy(lm.model, ids)
    assert pipe_for(lm).run(request("b")).token_ids == want


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8), "RGB")


def test_vision_language_adapter_on_the_tower_and_the_language_model(made):
    base_dir, path = made("qwen2-vl", "vision")
    lm = loaded(base_dir, {"v": path})
    adapter = lm.adapters.get("v")
    assert any(".visual." in name for name in adapter.layers)  # "qkv": the vision tower's attention
    assert any(".language_model." in name for name in adapter.layers)
    image = picture(1)
    ids, inputs = image_chat_inputs(lm, [image], "What is this?")
    want = greedy(merged_model(base_dir, path), ids, **inputs)
    base = greedy(lm.model, ids, **inputs)
    assert want != base
    pipe = pipe_for(lm)
    asks = [("v", image), (None, image), ("v", picture(2))]
    handles = [pipe.submit(request(name, "What is this?", images=[im])) for name, im in asks]
    got = [h.result().token_ids for h in handles]
    assert got[0] == want and got[1] == base
    again = pipe.run(request("v", "What is this?", images=[image]))  # the image's blocks from the cache: a's own
    assert again.token_ids == want and again.metrics["kv_reused_tokens"] > 0


def test_an_adapter_saved_against_transformers_4s_layout_is_renamed_as_from_pretrained_does(made, tmp_path):
    from safetensors.torch import load_file, save_file

    base_dir, path = made("qwen2-vl", "vision")
    old = shutil.copytree(path, tmp_path / "old-layout")
    weights = load_file(path / "adapter_model.safetensors")
    renames = {
        "base_model.model.model.language_model.": "base_model.model.model.",
        "base_model.model.model.visual.": "base_model.model.visual.",
    }
    saved = {next((k.replace(a, b) for a, b in renames.items() if k.startswith(a)), k): v for k, v in weights.items()}
    assert saved.keys() != weights.keys()  # as an adapter trained with transformers 4.x names Qwen2-VL's layers
    save_file(saved, old / "adapter_model.safetensors")
    lm = loaded(base_dir, {"new": path, "old": old})
    assert lm.adapters.get("old").layers.keys() == lm.adapters.get("new").layers.keys()
    pipe = pipe_for(lm)
    asks = [pipe.submit(request(name, "What is this?", images=[picture(3)])) for name in ("new", "old")]
    assert asks[0].result().token_ids == asks[1].result().token_ids


def test_audio_model_adapter_on_the_language_model(made):
    base_dir, path = made("qwen2-audio", "a")
    lm = loaded(base_dir, {"a": path})
    t = torch.arange(16000) / 16000
    wave = (0.4 * torch.sin(2 * torch.pi * 440 * t)).numpy()
    pipe = pipe_for(lm)
    ask = dict(prompt="What do you hear?", audios=[(wave, 16000)], max_new_tokens=N, ignore_eos=True)
    with_adapter, base = pipe.run(Request(adapter="a", **ask)), pipe.run(Request(**ask))
    assert with_adapter.token_ids != base.token_ids
    reference = merged_model(base_dir, path)
    lm_merged = load_model(str(base_dir), dtype=torch.float32, quant="none")
    lm_merged.model = reference
    assert pipe_for(lm_merged).run(Request(**ask)).token_ids == with_adapter.token_ids


# --------------------------------------------------------------------------- refused in one line


def broken(tmp_path, good, case: str):
    bad = tmp_path / case
    shutil.copytree(good, bad)
    if case == "no-weights":
        (bad / "adapter_model.safetensors").unlink()
    elif case == "no-config":
        (bad / "adapter_config.json").unlink()
    elif case == "dora":
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return bad


@pytest.mark.parametrize(
    "case, message",
    [
        ("no-weights", "its weights could not be read"),
        ("no-config", "not a peft adapter"),
        ("dora", r"DoRA \(use_dora\) is not supported"),
    ],
)
def test_broken_adapter_folder_is_refused_in_one_line(made, tmp_path, case, message):
    base_dir, good = made("qwen3", "a")
    lm = loaded(base_dir, {})
    with pytest.raises(UserError, match=message) as err:
        lm.load_adapter("x", str(broken(tmp_path, good, case)))
    assert "\n" not in str(err.value) and "adapter 'x'" in str(err.value)
    assert "x" not in lm.adapters


def test_a_missing_folder_or_an_unreachable_hub_id_is_one_line_at_once(made, monkeypatch, tmp_path):
    import pipeline.model.loading as loading

    lm = loaded(made("qwen3", "a")[0], {})
    with pytest.raises(UserError, match=r"adapter 'x' \(/no/such\): no such folder$"):
        lm.load_adapter("x", "/no/such")
    monkeypatch.setattr(loading, "hub_unreachable", lambda repo: "Name or service not known")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    with pytest.raises(UserError, match="cannot reach the Hugging Face hub to fetch it .no network. Name or service"):
        lm.load_adapter("x", "someone/some-lora")


def test_adapter_of_another_base_or_unsupported_layers_is_refused(made, held_out_dir, tmp_path):
    base_dir, _ = made("qwen3", "a")
    lm = loaded(base_dir, {})
    other = make_adapter(held_out_dir("qwen2-vl"), tmp_path / "other", seed=5)  # another model's names
    with pytest.raises(UserError, match="which this model does not have"):
        lm.load_adapter("o", str(other))
    embed = make_adapter(base_dir, tmp_path / "embed", seed=6, targets=["embed_tokens"])
    with pytest.raises(UserError, match="not a LoRA linear layer's factor"):
        lm.load_adapter("e", str(embed))
    lm.load_adapter("a", str(made("qwen3", "a")[1]))
    with pytest.raises(UserError, match="already loaded"):
        lm.load_adapter("a", str(made("qwen3", "a")[1]))


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["adapter=a"], r"adapter=a: no such adapter \(model.lora is empty"),
        (["model.lora={a: /x}", "adapter=b"], r"adapter=b: no such adapter \(model.lora names a;"),
        (["model.lora={a: /x}", "adapter=a", "mode=serve"], "a request names its adapter as model"),
        (["model.lora=/x"], "model.lora must map names to adapter folders"),
    ],
)
def test_adapter_settings_are_refused_before_anything_loads(overrides, message):
    from hydra import compose, initialize_config_dir

    from conftest import ROOT
    from pipeline.cli.settings import check_numbers

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["model.path=/x", *overrides])
    with pytest.raises(UserError, match=message):
        check_numbers(cfg)


def test_cli_adapter_equals_merged_generate_and_broken_folder_is_one_line(made, tmp_path):
    base_dir, path = made("qwen3", "a")
    lm = load_model(str(base_dir), dtype=torch.float32, quant="none")
    want = lm.tokenizer.decode(greedy(merged_model(base_dir, path), chat_ids(lm)), skip_special_tokens=True)
    common = [f"model.path={base_dir}", "quant=none", f"prompt={PROMPT}", f"max_new_tokens={N}", "metrics_table=false"]
    out = run_cli(*common, f"model.lora={{a: {path}}}", "adapter=a", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want.strip()
    assert "LoRA adapters: a (rank 4" in out.stderr
    bad = broken(tmp_path, path, "no-weights")
    out = run_cli(*common, f"model.lora={{a: {bad}}}", "adapter=a", cwd=tmp_path)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith("error: adapter 'a'")
    assert "Traceback" not in out.stderr
