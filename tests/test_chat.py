"""Chat: every turn equals a fresh greedy run of the whole conversation, while the KV cache is
reused across turns (only new tokens are prefilled), rolled back by /undo and after Ctrl-C."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from conftest import generate_oracle, run_cli
from pipeline import Pipeline, Request, UserError
from pipeline.frontends.chat_session import ChatSession
from pipeline.modes.chat import COMMANDS, Repl
from pipeline.frontends.prefix import common_prefix_length, run_shared_prefix
from stages import DecodeLoop, Prefill, Sampler, Tokenize

N = 10


def make_pipe(lm) -> Pipeline:
    return Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop(Sampler())})


def oracle(lm, messages: list[dict], n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy generate ids) of a conversation rendered by the model's own template."""
    ids = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ].to(lm.device)
    return ids[0].tolist(), generate_oracle(lm, ids, n)


def common(a: list, b: list) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def expected_reuse(cached: list, prompt: list) -> int:
    """What the tokens allow: the common prefix with the cache, leaving one token to compute."""
    return max(0, min(common(cached, prompt), len(prompt) - 1))


def read_log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "chat.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lm(load_tiny):
    return load_tiny("qwen3")


@pytest.fixture(scope="module")
def pipe(lm):
    return make_pipe(lm)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_three_turns_match_generate_and_prefill_only_new_tokens(load_tiny, family, tmp_path):
    lm = load_tiny(family)
    chat = ChatSession(make_pipe(lm), max_new_tokens=N, log_path=tmp_path / "chat.jsonl")
    prompts: list[list[int]] = []
    for k, text in enumerate(["Hi there.", "Tell me about the sea.", "And the sky?"]):
        cached = list(chat.cache.keys)
        result = chat.send(text)
        prompt, tokens = oracle(lm, chat.messages[:-1])  # the history with this message, before the answer
        assert result.prompt_ids == prompt
        assert result.token_ids == tokens
        m = result.metrics
        assert m["kv_reused_tokens"] == expected_reuse(cached, prompt)
        assert m["prefill_tokens"] == len(prompt) - m["kv_reused_tokens"]
        if k:  # at least the whole rendered prompt the two turns share is never recomputed
            assert m["kv_reused_tokens"] >= common(prompts[-1], prompt) > 0
        # The cache now holds this prompt and the answer's fed tokens (the last one is not fed).
        assert chat.cache.keys == prompt + result.token_ids[:-1]
        prompts.append(prompt)
    log = read_log(tmp_path)
    assert [r["turn"] for r in log] == [1, 2, 3] and all(r["event"] == "turn" for r in log)
    assert [r["user"] for r in log] == ["Hi there.", "Tell me about the sea.", "And the sky?"]
    assert [r["token_ids"] for r in log] == [t.result.token_ids for t in chat.turns]
    assert log[1]["metrics"]["kv_reused_tokens"] == chat.turns[1].result.metrics["kv_reused_tokens"]


def test_undo_then_other_message_equals_fresh_run_without_recompute(lm, pipe, tmp_path):
    chat = ChatSession(pipe, max_new_tokens=N, system_prompt="Be brief.", log_path=tmp_path / "chat.jsonl")
    first = chat.send("Hi there.")
    after_first = list(chat.cache.keys)
    second = chat.send("Tell me about the sea.")
    undone = chat.undo()
    assert undone is not None and undone.result is second and len(chat.turns) == 1
    kept = second.metrics["kv_reused_tokens"]
    assert chat.cache.length == kept and len(chat.cache.blocks) == -(-kept // chat.cache.block_size)
    assert chat.cache.keys == after_first[:kept]  # back to the first turn's cache, nothing recomputed
    other = chat.send("What is a cloud?")
    system = [{"role": "system", "content": "Be brief."}]
    prompt, tokens = oracle(
        lm,
        system
        + [
            {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "What is a cloud?"},
        ],
    )
    assert other.prompt_ids == prompt and other.token_ids == tokens
    assert other.metrics["kv_reused_tokens"] == expected_reuse(after_first[:kept], prompt)
    assert chat.undo() is not None and chat.undo() is not None and chat.undo() is None
    assert chat.cache.length == 0 and chat.messages == []
    events = [(r["event"], r["turn"]) for r in read_log(tmp_path)]
    assert events == [("turn", 1), ("turn", 2), ("undo", 2), ("turn", 2), ("undo", 2), ("undo", 1)]


def test_reset_forgets_everything(lm, pipe, tmp_path):
    chat = ChatSession(pipe, max_new_tokens=N, log_path=tmp_path / "chat.jsonl")
    chat.send("Hi there.")
    chat.reset()
    assert chat.cache.length == 0 and chat.messages == [] and chat.last is None
    result = chat.send("Count to five.")
    prompt, tokens = oracle(lm, [{"role": "user", "content": "Count to five."}])
    assert result.token_ids == tokens and result.metrics["kv_reused_tokens"] == 0
    assert [r["event"] for r in read_log(tmp_path)] == ["turn", "reset", "turn"]


def test_interrupt_from_stream_drops_turn_and_keeps_cache_consistent(lm, pipe, tmp_path):
    chat = ChatSession(pipe, max_new_tokens=N, ignore_eos=True, log_path=tmp_path / "chat.jsonl")
    first = chat.send("Hi there.")
    before = list(chat.cache.keys)

    def ctrl_c(piece: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat.send("Tell me about the sea.", on_text=ctrl_c)
    assert len(chat.turns) == 1 and chat.last is first
    assert chat.cache.keys == before[: chat.cache.length]
    assert len(chat.cache.blocks) == -(-chat.cache.length // chat.cache.block_size)  # no block past the keys
    again = chat.send("Tell me about the sea.")
    ids = lm.tokenizer.apply_chat_template(
        chat.messages[:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert again.token_ids == generate_oracle(lm, ids, N, ignore_eos=True)
    assert [r["event"] for r in read_log(tmp_path)] == ["turn", "interrupted", "turn"]


def test_interrupt_between_layers_is_recovered(lm, pipe):
    """Ctrl-C can land inside a forward pass, after layer 0 wrote its keys but before layer 1 did."""
    chat = ChatSession(pipe, max_new_tokens=N, ignore_eos=True)
    chat.send("Hi there.")
    calls = {"n": 0}

    def hook(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # prefill, then two decode steps into the second answer
            raise KeyboardInterrupt

    handle = lm.model.model.layers[1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            chat.send("Tell me about the sea.")
    finally:
        handle.remove()
    assert len(chat.cache.blocks) == -(-chat.cache.length // chat.cache.block_size) and len(chat.turns) == 1
    again = chat.send("Tell me about the sea.")
    ids = lm.tokenizer.apply_chat_template(
        chat.messages[:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    assert again.token_ids == generate_oracle(lm, ids, N, ignore_eos=True)


def test_bad_input_leaves_the_session_untouched(pipe, tmp_path):
    chat = ChatSession(pipe, max_new_tokens=N)
    wav = tmp_path / "tone.wav"
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16000)
    with pytest.raises(UserError, match="file not found"):
        chat.attach(tmp_path / "missing.png")
    with pytest.raises(UserError, match="without an audio encoder"):
        chat.attach(wav)
    with pytest.raises(UserError, match="not an image"):
        chat.attach(wav, "image")
    with pytest.raises(UserError, match="empty"):
        chat.send("   ")
    with pytest.raises(UserError, match="max_new_tokens"):
        ChatSession(pipe, max_new_tokens=0)
    assert chat.pending == [] and chat.turns == [] and chat.cache.length == 0


# --- shared-prefix continuations ---------------------------------------------------------------
def test_shared_prefix_answers_equal_fresh_runs(lm, pipe):
    history = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello! How can I help?"}]
    requests = [
        Request(messages=history + [{"role": "user", "content": q}], system_prompt="Be brief.", max_new_tokens=N)
        for q in ("Tell me about the sea.", "Count to five.", "What is a cloud?")
    ]
    shared = common_prefix_length(pipe, requests)
    seen: list[int] = []
    results = run_shared_prefix(pipe, requests, on_result=lambda i, r: seen.append(i))
    assert seen == [0, 1, 2]
    assert results[0].metrics["kv_reused_tokens"] == 0
    for i, (request, result) in enumerate(zip(requests, results)):
        prompt, tokens = oracle(lm, [{"role": "system", "content": "Be brief."}] + request.messages)
        assert result.prompt_ids == prompt and result.token_ids == tokens  # as a fresh run gives
        if i:
            assert shared == common(prompt, results[0].prompt_ids) > 0
            assert result.metrics["kv_reused_tokens"] == shared
            assert result.metrics["prefill_tokens"] == len(prompt) - shared


def test_shared_prefix_on_a_warm_cache(pipe):
    """A cache that already holds something else is reused as far as it matches, never wrongly."""
    cache = pipe.new_cache()
    pipe.run(Request(prompt="Something unrelated entirely.", max_new_tokens=N), cache=cache)
    requests = [Request(prompt=p, max_new_tokens=N) for p in ("Red or blue?", "Red or green?")]
    results = run_shared_prefix(pipe, requests, cache=cache)
    assert [r.token_ids for r in results] == [pipe.run(r).token_ids for r in requests]


def test_shared_prefix_reports_a_failing_request_and_answers_the_rest(pipe):
    """A request that fails at run time (here max_new_tokens=0, caught in the decode stage) is
    reported through on_error; the others still equal fresh runs."""
    prompts = ("Red or blue?", "Red or pink?", "Red or green?")
    requests = [Request(prompt=p, max_new_tokens=0 if i == 1 else N) for i, p in enumerate(prompts)]
    errors: list[tuple[int, str]] = []
    results = run_shared_prefix(pipe, requests, on_error=lambda i, err: errors.append((i, str(err))))
    assert [i for i, _ in errors] == [1] and "max_new_tokens" in errors[0][1]
    assert results[1] is None
    for i in (0, 2):
        assert results[i].token_ids == pipe.run(requests[i]).token_ids
    with pytest.raises(UserError):  # without on_error the error propagates
        run_shared_prefix(pipe, requests)


# --- media identity ----------------------------------------------------------------------------
def test_cache_never_matches_a_different_image_of_the_same_size(pipe):
    """KVCache level: media positions carry content hashes, so equal ids with other pixels differ."""
    from pipeline.media import content_hash

    red = Image.new("RGB", (56, 56), (255, 0, 0))
    blue = Image.new("RGB", (56, 56), (0, 0, 255))
    pad = 151655

    def keys(image: Image.Image) -> list:
        h = content_hash(image)
        return [1, 2, 3] + [(pad, h, i) for i in range(4)] + [4, 5]

    cache = pipe.new_cache()
    cache.reserve(len(keys(red)))
    cache.append(keys(red))  # only keys are compared by reuse; what the blocks hold does not matter here
    assert cache.common_prefix(keys(blue)) == 3
    assert cache.common_prefix(keys(red.copy())) == len(keys(red))


def test_images_are_reused_only_when_the_pixels_match(load_tiny, tmp_path):
    """Qwen2-VL end to end: same size, other pixels -> recomputed from the image on; same -> reused."""
    from stages import VisionEncoder

    lm = load_tiny("qwen2-vl")
    pipe = Pipeline(
        lm,
        {
            "tokenize": Tokenize(),
            "vision_encoder": VisionEncoder(),
            "prefill": Prefill(),
            "decode": DecodeLoop(Sampler()),
        },
    )
    pad = int(lm.config.image_token_id)
    red, blue = (Image.new("RGB", (56, 56), c) for c in ((220, 30, 30), (30, 30, 220)))
    blue.save(tmp_path / "blue.png")

    def ask(image, cache=None):
        return pipe.run(Request(prompt="Describe.", images=[image], max_new_tokens=N), cache=cache)

    cache = pipe.new_cache()
    ask(red, cache)
    on_red = ask(blue, cache)  # the same ids as the red prompt, other pixels
    assert on_red.metrics["kv_reused_tokens"] == on_red.prompt_ids.index(pad)
    fresh = ask(blue)
    assert on_red.token_ids == fresh.token_ids

    chat = ChatSession(pipe, max_new_tokens=N)
    chat.attach(tmp_path / "blue.png")
    first = chat.send("Describe.")
    assert first.token_ids == fresh.token_ids
    second = chat.send("And the colours?")  # the picture is still in the history: cached, not re-encoded
    last_pad = len(second.prompt_ids) - 1 - second.prompt_ids[::-1].index(pad)
    assert second.metrics["kv_reused_tokens"] > last_pad and second.metrics["megapixels"] == 0
    again = pipe.run(Request(messages=chat.messages[:-1], images=chat.turns[0].images, max_new_tokens=N))
    assert second.token_ids == again.token_ids


# --- the REPL ----------------------------------------------------------------------------------
class CtrlCOnce(io.StringIO):
    """stdout that raises KeyboardInterrupt on the first write, as Ctrl-C during an answer would."""

    def __init__(self) -> None:
        super().__init__()
        self.fired = False

    def write(self, s: str) -> int:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return super().write(s)


def repl(pipe, lines: str, stdout: io.StringIO | None = None, **kwargs) -> tuple[ChatSession, str, str]:
    chat = ChatSession(pipe, max_new_tokens=N, **kwargs)
    out, err = stdout or io.StringIO(), io.StringIO()
    Repl(chat, stdin=io.StringIO(lines), stdout=out, stderr=err).loop()
    return chat, out.getvalue(), err.getvalue()


def test_repl_commands_in_process(pipe, tmp_path):
    wav = tmp_path / "tone.wav"
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16000)
    script = (
        "\n".join(
            [
                "/stats",
                "",
                "   ",
                "/bogus",
                "/help",
                "/undo",
                "/image",
                f"/audio {wav}",
                f"/image {tmp_path}/none.png",
                "Hi there.",
                "/stats",
                "//slash at the start",
                "/undo",
                "/reset",
                "/exit",
                "never sent",
            ]
        )
        + "\n"
    )
    chat, out, err = repl(pipe, script)
    lines = err.splitlines()
    assert "no turn yet" in lines and "nothing to undo" in lines
    assert f"unknown command /bogus: commands are {COMMANDS}" in lines
    assert "/image PATH" in err and "Ctrl-C" in err  # the help text
    assert "usage: /image PATH" in lines
    assert any(line.startswith("error:") and "without an audio encoder" in line for line in lines)
    assert any(line.startswith("error:") and "none.png: file not found" in line for line in lines)
    assert "kv_reused_tokens" in err and "turn 1  finish=" in err  # /stats after the first turn
    assert len(out.splitlines()) == 2  # two answers; "never sent" came after /exit
    assert chat.turns == [] and chat.cache.length == 0  # /undo then /reset


def test_repl_slash_escape_sends_the_line(lm, pipe):
    chat, out, _ = repl(pipe, "//etc is a folder\n")
    assert chat.turns[0].user == "/etc is a folder"
    assert out == chat.turns[0].result.text + "\n"


def test_repl_ctrl_c_drops_the_answer_and_keeps_the_session(lm, pipe):
    chat, out, err = repl(pipe, "Hi there.\nCount to five.\n", stdout=CtrlCOnce())
    assert "[stopped: answer dropped from the conversation" in err
    assert [t.user for t in chat.turns] == ["Count to five."]
    _, tokens = oracle(lm, [{"role": "user", "content": "Count to five."}])
    assert chat.turns[0].result.token_ids == tokens


def test_repl_through_cli_with_piped_stdin(tiny_dir, lm, tmp_path):
    script = "\n/stats\n/bogus\n/undo\nTell me about the sea.\n/image /no/such/cat.png\nCount to three.\n"
    proc = run_cli(
        "mode=chat",
        f"model.path={tiny_dir('qwen3')}",
        f"max_new_tokens={N}",
        "prompt=Hi there.",
        f"hydra.run.dir={tmp_path}",
        input=script,
    )  # ends with EOF, as Ctrl-D does
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    log = read_log(tmp_path)
    turns = [r for r in log if r["event"] == "turn"]
    assert [(r["event"], r["turn"]) for r in log] == [("turn", 1), ("undo", 1), ("turn", 1), ("turn", 2)]
    assert proc.stdout == "".join(r["text"] + "\n" for r in turns)  # stdout holds only the answers
    assert f"unknown command /bogus: commands are {COMMANDS}" in proc.stderr
    assert "error: /no/such/cat.png: file not found" in proc.stderr
    assert "kv_reused_tokens" in proc.stderr
    _, tokens = oracle(lm, [{"role": "user", "content": "Hi there."}])
    assert turns[0]["token_ids"] == tokens
    history = [{"role": "user", "content": "Tell me about the sea."}]
    _, tokens = oracle(lm, history)
    assert turns[1]["token_ids"] == tokens
    prompt, tokens = oracle(
        lm,
        history + [{"role": "assistant", "content": turns[1]["text"]}, {"role": "user", "content": "Count to three."}],
    )
    assert turns[2]["token_ids"] == tokens
    assert turns[2]["metrics"]["kv_reused_tokens"] > 0
    assert turns[2]["metrics"]["prefill_tokens"] == len(prompt) - turns[2]["metrics"]["kv_reused_tokens"]
