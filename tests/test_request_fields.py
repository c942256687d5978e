"""Request fields clients of vLLM send (issue 50), through the engine on a tiny Qwen3 and checked
against transformers' ``generate()``: ``stop_token_ids``, ``min_new_tokens`` (EOS, stop ids and
stop strings held back), ``continue_final_message`` (the last assistant message continued), and
``priority`` (lower first; a running request of a lower priority is preempted and still gets its
solo answer)."""

from __future__ import annotations

import pytest
import torch

from pipeline import Pipeline, Request, UserError
from pipeline.engine.output import Output
from stages import DecodeLoop, Prefill, Tokenize

PROMPT = "Tell me a story about the sea."


def engine(lm, max_seqs: int = 8) -> Pipeline:
    stages = {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}
    return Pipeline(lm, stages, kv_memory=16 << 20, max_seqs=max_seqs)


def generate(lm, ids: list[int], **kw) -> list[int]:
    out = lm.model.generate(torch.tensor([ids]), do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids) :].tolist()


def test_a_stop_token_id_ends_the_answer_as_generate_does(load_tiny):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    free = pipe.run(Request(prompt=PROMPT, max_new_tokens=12, ignore_eos=True))
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    result = pipe.run(Request(prompt=PROMPT, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop]))
    assert result.token_ids == free.token_ids[: first + 1] and result.finish_reason == "stop"
    assert result.token_ids == generate(lm, free.prompt_ids, max_new_tokens=12, eos_token_id=[stop])


def test_min_new_tokens_holds_the_end_back_as_generate_does(load_tiny):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    free = pipe.run(Request(prompt=PROMPT, max_new_tokens=12, ignore_eos=True))
    stop = free.token_ids[0]  # would end the answer at once
    held = Request(prompt=PROMPT, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop], min_new_tokens=5)
    result = pipe.run(held)
    reference = generate(lm, free.prompt_ids, max_new_tokens=12, min_new_tokens=5, eos_token_id=[stop])
    assert result.token_ids == reference and len(result.token_ids) >= 5
    assert stop not in result.token_ids[:5]


def test_a_stop_string_inside_min_new_tokens_is_passed_over():
    class Letters:  # a tokenizer whose token i is the letter chr(97 + i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    streamed: list[str] = []
    out = Output(Letters(), max_new_tokens=10, stops=["bc"], eos=frozenset(), on_text=streamed.append, min_new_tokens=3)
    generated: list[int] = []
    for token in [1, 2, 3, 1, 2]:  # "bc" at tokens 1-2 (within 3: passed over), again at 4-5
        generated.append(token)
        reason = out.accept(generated)
    assert reason == "stop" and out.final_text(generated, "stop") == "bcd" and "".join(streamed) == "bcd"


def test_continue_final_message_continues_the_assistants_text(load_tiny):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Once upon a"}]
    request = Request(messages=messages, max_new_tokens=6, add_generation_prompt=False, continue_final_message=True)
    ctx = pipe.run_context(request)
    text = ctx.extras["prompt_text"]
    assert text.endswith("Once upon a") and text.count("<|im_start|>assistant") == 1
    ids = ctx.input_ids[0].tolist()
    assert ctx.generated == generate(lm, ids, max_new_tokens=6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"continue_final_message": True}, "needs add_generation_prompt false"),
        ({"continue_final_message": True, "add_generation_prompt": False, "last": "user"}, "assistant's"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"min_new_tokens": 50}, "min_new_tokens must be"),
    ],
)
def test_bad_fields_fail_that_request_alone(load_tiny, fields, message):
    lm = load_tiny("qwen3")
    pipe = engine(lm)
    last = fields.pop("last", "assistant")
    messages = [{"role": "user", "content": PROMPT}] + (
        [{"role": "assistant", "content": "Once"}] if last == "assistant" else []
    )
    good = pipe.submit(Request(prompt=PROMPT, max_new_tokens=4, ignore_eos=True))
    bad = pipe.submit(Request(messages=messages, max_new_tokens=4, **fields))
    with pytest.raises(UserError, match=message):
        bad.result()
    assert len(good.result().token_ids) == 4


def test_a_high_priority_request_preempts_and_every_answer_is_its_solo_one(load_tiny):
    lm = load_tiny("qwen3")
    pipe = engine(lm, max_seqs=1)
    low, high = Request(prompt=PROMPT, max_new_tokens=24, ignore_eos=True), Request(prompt="Hi!", max_new_tokens=4)
    solo = [pipe.run(Request(prompt=r.prompt, max_new_tokens=r.max_new_tokens, ignore_eos=True)) for r in (low, high)]
    low.priority, high.priority, high.ignore_eos = 5, 0, True
    order: list[str] = []
    first = pipe.submit(low)
    first.add_done_callback(lambda _: order.append("low"))
    pipe.engine.drive(lambda: len(first.context.generated) >= 3)  # the low-priority request is decoding
    second = pipe.submit(high)
    second.add_done_callback(lambda _: order.append("high"))
    results = [first.result(), second.result()]
    assert order == ["high", "low"] and results[0].metrics["preemptions"] == 1
    assert [r.token_ids for r in results] == [r.token_ids for r in solo]
