"""LoRA adapters over HTTP, vLLM's way, on a model the project did not build (the held-out Qwen3:
``quant=auto`` picks int8wo on CPU, what users get). One server with ``model.lora={a: DIR}``:

- ``model=a`` answers token for token as the engine does in this process with ``Request(adapter="a")``
  on the same weights (the same settings, loaded by the same code); ``model=<base>`` as the base,
  which answers otherwise; chat (whole and streamed), the Responses API, embeddings and /tokenize
  take the adapter's name, and every answer echoes the name asked for;
- ``/v1/models`` lists each adapter with its ``parent`` (the base) and ``root`` (its folder);
- ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's texts): an adapter loaded at run
  time serves until unloaded, then its name is a 404; a broken adapter, a name taken and unknown
  fields are a 400 with one line; requests of three models at once each get their solo answer.

Without a server: the engine's adapter rows equal peft's merged model (float32, no quantisation)
token for token, alone and sharing steps with another adapter's rows; ``serve.runtime_lora=false``
closes the endpoints and the API key guards them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import peft
import pytest
import torch
from hydra import compose, initialize_config_dir
from openai import NotFoundError, OpenAI
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.testing.lora import make_adapter, merged_model
from serving import ROOT, serving

PROMPT = "Tell me about the sea."  # base, a and b answer it differently (checked)
TOKENS = 10
BASE = "held-out-qwen3"  # the base's served name


def other_base_adapter(base_dir: Path, out: Path) -> Path:
    """An adapter of a model like ``base_dir``'s but for its MLP's width: down_proj of other shapes."""
    config = AutoConfig.from_pretrained(base_dir)
    config.intermediate_size //= 2
    torch.manual_seed(3)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"], init_lora_weights=False)
    peft.get_peft_model(AutoModelForCausalLM.from_config(config), lora).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(held_out_dir, tmp_path_factory) -> dict[str, Path]:
    """The base model, adapters a and b of it, and two that cannot serve on it."""
    tmp = tmp_path_factory.mktemp("lora")
    base = held_out_dir("qwen3")
    out = {"base": base, "a": make_adapter(base, tmp / "a", seed=1), "b": make_adapter(base, tmp / "b", seed=2)}
    out["no_weights"] = tmp / "no-weights"  # adapter_config.json without adapter_model.safetensors
    out["no_weights"].mkdir()
    shutil.copy(out["a"] / "adapter_config.json", out["no_weights"])
    out["other_base"] = other_base_adapter(base, tmp / "other-base")
    return out


def overrides(dirs: dict[str, Path]) -> list[str]:
    """The server's settings: the defaults, the held-out model, adapter a."""
    return [f"model.path={dirs['base']}", f"model.lora={{a: '{dirs['a']}'}}", f"serve.model_name={BASE}"]


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve-lora"), *overrides(dirs), f"max_new_tokens={TOKENS}") as server:
        server.client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield server


@pytest.fixture(scope="module")
def oracle(dirs):
    """The server's pipeline, built in this process by the same code from the same settings, with b too."""
    from pipeline.cli.assemble import load_from_cfg, pipeline_from_cfg, stages_from_cfg

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=["mode=serve", *overrides(dirs)])
    pipe = pipeline_from_cfg(cfg, load_from_cfg(cfg), stages_from_cfg(cfg))
    assert pipe.lm.quant == "int8wo"  # what a user's checkpoint gets on CPU
    pipe.load_adapter("b", str(dirs["b"]))
    return pipe


def solo(oracle, adapter: str | None) -> list[int]:
    """The in-process answer's token ids (greedy)."""
    from pipeline import Request

    request = Request(messages=[{"role": "user", "content": PROMPT}], max_new_tokens=TOKENS, adapter=adapter)
    return oracle.run(request).token_ids


def chat(server, model: str) -> tuple[list[list[int]], str]:
    """The server's greedy answer: each token's bytes (what identifies it) and the text."""
    answer = server.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS, temperature=0, logprobs=True
    )
    assert answer.model == model
    return [t.bytes for t in answer.choices[0].logprobs.content], answer.choices[0].message.content


def as_bytes(oracle, ids: list[int]) -> list[list[int]]:
    from pipeline.engine.output import TokenTexts

    texts = TokenTexts(oracle.lm.tokenizer)
    return [texts.bytes(t) for t in ids]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_an_adapter_answers_as_the_engine_does_in_process_and_the_base_as_the_base(server, oracle):
    answers = {}
    for model, adapter in (("a", "a"), (BASE, None)):
        ids = solo(oracle, adapter)
        got, text = chat(server, model)
        assert got == as_bytes(oracle, ids) and text == oracle.lm.tokenizer.decode(ids)
        answers[model] = text
    assert answers["a"] != answers[BASE]
    stream = server.client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"a"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answers["a"]
    response = server.client.responses.create(model="a", input=PROMPT, max_output_tokens=TOKENS, temperature=0)
    assert response.model == "a" and response.output_text == answers["a"]  # the chat path's answer


def test_other_endpoints_take_the_adapters_name_and_refuse_an_unknown_one(server):
    base = server.client.embeddings.create(model=BASE, input=PROMPT)
    adapted = server.client.embeddings.create(model="a", input=PROMPT)
    assert adapted.model == "a" and base.model == BASE
    assert not np.allclose(base.data[0].embedding, adapted.data[0].embedding, atol=1e-3)  # a's hidden states
    tokens = [post(server, "/tokenize", {"model": m, "prompt": PROMPT}).json()["tokens"] for m in ("a", BASE)]
    assert tokens[0] == tokens[1]
    with pytest.raises(NotFoundError) as err:
        server.client.chat.completions.create(model="zzz", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "'a'" in err.value.body["message"]
    assert post(server, "/tokenize", {"model": "zzz", "prompt": "hi"}).status_code == 404


def test_models_lists_each_adapter_with_its_parent(server, dirs):
    cards = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert [m.id for m in server.client.models.list().data][:2] == [BASE, "a"]  # the base first (the chat page's)
    assert cards[BASE]["parent"] is None and cards[BASE]["root"] == str(dirs["base"])
    assert cards[BASE]["max_model_len"] > 0
    a = cards["a"]
    assert a["object"] == "model" and a["parent"] == BASE and a["root"] == str(dirs["a"])
    assert a["owned_by"] == cards[BASE]["owned_by"] and isinstance(a["created"], int)
    metrics = httpx.get(server.url + "/metrics").text  # vLLM's gauge: adapters loaded, none in flight now
    assert f'vllm:lora_requests_info{{max_lora="{len(cards) - 1}",running_lora_adapters="",' in metrics


def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(server, oracle, dirs):
    loaded = post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(dirs["b"])})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'b' added successfully."
    assert [m.id for m in server.client.models.list().data] == [BASE, "a", "b"]
    assert chat(server, "b")[0] == as_bytes(oracle, solo(oracle, "b"))
    unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'b' removed successfully."
    with pytest.raises(NotFoundError):
        chat(server, "b")
    again = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert again.status_code == 404 and again.json()["error"]["message"] == "The lora adapter 'b' cannot be found."
    assert [m.id for m in server.client.models.list().data] == [BASE, "a"]


@pytest.mark.parametrize(
    "name, path, extra, words",
    [
        ("x", "no_weights", {}, "its weights could not be read"),
        ("x", "other_base", {}, "trained on another base model"),
        ("x", "missing", {}, "no such folder"),
        ("a", "b", {}, "The lora adapter 'a' has already been loaded."),
        (BASE, "b", {}, "is the base model's name"),
        ("x", "b", {"load_inplace": True}, "load_inplace: not supported"),
        ("x", "b", {"model": BASE}, "model: not supported"),
    ],
)
def test_a_broken_adapter_a_name_taken_or_an_unknown_field_is_a_400_in_one_line(server, dirs, name, path, extra, words):
    source = str(dirs.get(path, dirs["base"] / path))
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": source, **extra})
    error = answer.json()["error"]
    assert answer.status_code == 400 and words in error["message"] and "\n" not in error["message"], error
    assert "x" not in {m.id for m in server.client.models.list().data}


def test_requests_for_three_models_at_once_each_get_their_solo_answer(server, dirs):
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs["b"])}).status_code == 200
    try:
        models = ["a", BASE, "c"] * 2
        alone = {m: chat(server, m) for m in set(models)}
        with ThreadPoolExecutor(len(models)) as pool:
            together = list(pool.map(lambda m: chat(server, m), models))
        assert together == [alone[m] for m in models]
        assert len({alone[m][1] for m in alone}) == 3
    finally:
        post(server, "/v1/unload_lora_adapter", {"lora_name": "c"})


# --- without a server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exact(dirs):
    """The held-out model in float32 without quantisation, adapters a and b beside it."""
    from pipeline import Pipeline, load_model
    from stages import DecodeLoop, Prefill, Tokenize

    lm = load_model(str(dirs["base"]), quant="none", dtype=torch.float32)
    pipe = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}, kv_memory=8 << 20)
    for name in ("a", "b"):
        pipe.load_adapter(name, str(dirs[name]))
    return pipe


def test_adapter_rows_equal_peft_merged_models_token_for_token(exact, dirs):
    from pipeline import Request

    request = dict(messages=[{"role": "user", "content": PROMPT}], max_new_tokens=TOKENS, ignore_eos=True)
    handles = {name: exact.submit(Request(**request, adapter=name)) for name in ("a", "b")}  # rows share steps
    exact.engine.drive(lambda: all(h.done() for h in handles.values()))
    for name, handle in handles.items():
        together = handle.result()
        prompt = torch.tensor([together.prompt_ids])
        with torch.inference_mode():
            reference = merged_model(dirs["base"], dirs[name]).generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=TOKENS,
                min_new_tokens=TOKENS,
            )
        assert together.token_ids == reference[0, prompt.shape[1] :].tolist()
        assert exact.run(Request(**request, adapter=name)).token_ids == together.token_ids  # alone


def asgi(app, *calls: tuple[str, dict, dict]) -> list[httpx.Response]:
    """POST each (path, body, headers) to the app in this process."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve") as http:
            return [await http.post(path, json=body, headers=headers) for path, body, headers in calls]

    return asyncio.run(run())


def test_runtime_lora_false_closes_the_endpoints_and_the_api_key_guards_them(exact, dirs):
    from pipeline.serve.app import create_app
    from pipeline.serve.protocol import ServeSettings

    load = {"lora_name": "d", "lora_path": str(dirs["b"])}
    off = create_app(exact, ServeSettings(model_name="m", runtime_lora=False))
    for answer in asgi(off, ("/v1/load_lora_adapter", load, {}), ("/v1/unload_lora_adapter", {"lora_name": "a"}, {})):
        assert answer.status_code == 404 and "serve.runtime_lora=false" in answer.json()["error"]["message"]
    assert "d" not in exact.lm.adapters and "a" in exact.lm.adapters
    keyed = create_app(exact, ServeSettings(model_name="m", api_key="k"))
    key = {"Authorization": "Bearer k"}
    refused, loaded, unloaded = asgi(
        keyed,
        ("/v1/load_lora_adapter", load, {}),
        ("/v1/load_lora_adapter", load, key),
        ("/v1/unload_lora_adapter", {"lora_name": "d"}, key),
    )
    assert refused.status_code == 401 and json.loads(refused.text)["error"]["code"] == "invalid_api_key"
    assert loaded.status_code == 200 and unloaded.status_code == 200 and "d" not in exact.lm.adapters
