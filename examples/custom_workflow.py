"""Compose stages by hand: prefill a prompt once, then branch two continuations from it.

    python examples/custom_workflow.py [--model DIR_OR_HUB_ID]

Runs on the embedded default (a toy model trained only to name the shapes in images: to this
text prompt its words are meaningless, the mechanics are real). The greedy branch is checked
against a plain Pipeline run.
"""
from __future__ import annotations

import argparse
import dataclasses

from pipeline import Metrics, Pipeline, Request, load_model
from stages import DecodeLoop, Prefill, Sampler, Tokenize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or hub id (default: the embedded tiny model)")
    parser.add_argument("--prompt", default="Write a short poem about the sea.")
    args = parser.parse_args()
    if args.model is None:
        from pipeline.tiny import default_model_dir

        args.model = str(default_model_dir())
    lm = load_model(args.model)
    pipe = Pipeline(lm, {})  # no stages: we drive them ourselves, with the pipeline's context and timing
    request = Request(prompt=args.prompt, max_new_tokens=16)

    ctx = pipe.context(request)
    ctx.metrics.start()
    with ctx.metrics.span("tokenize"):
        Tokenize()(ctx)
    with ctx.metrics.span("prefill"):
        Prefill()(ctx)
    prefix = ctx.cache.snapshot()  # the prompt's KV, to come back to
    print(f"prompt: {ctx.cache.length} tokens prefilled once, {ctx.cache.nbytes:,} bytes of KV")

    samplers = {"greedy": Sampler(), "creative": Sampler(temperature=0.9, top_p=0.9, seed=0)}
    branches = {}
    for name, sampler in samplers.items():
        ctx.cache.restore(prefix)  # roll back whatever the previous branch appended
        branch = dataclasses.replace(ctx, generated=[], text="", metrics=Metrics(lm.device))
        branch.metrics.start()
        with branch.metrics.span("decode"):
            DecodeLoop(sampler)(branch)
        branch.metrics.end()
        branches[name] = branch
        m = branch.metrics.to_dict()
        print(f"[{name}] {branch.text!r}  ({m['generated_tokens']} tokens, {m['decode_tok_s']:.1f} tok/s decode)")

    reference = Pipeline(lm, {"tokenize": Tokenize(), "prefill": Prefill(), "decode": DecodeLoop()}).run(request)
    assert reference.token_ids == branches["greedy"].generated, "greedy branch differs from a plain run"
    print("greedy branch == plain pipeline run: OK")


if __name__ == "__main__":
    main()
