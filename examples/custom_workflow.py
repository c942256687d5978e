"""Compose stages by hand: prefill a prompt once, then branch two continuations from it.

    python examples/custom_workflow.py [--model DIR_OR_HUB_ID] [--prompt TEXT] [--image PATH]

With no --model it runs on the embedded default (a toy Qwen2-VL trained only to name the shapes
in images) and asks it its own question about its example image, so both branches answer
("a blue triangle and a red circle"-like). Give --image "" for a text-only prompt. The stages
driven here run on the model's shared engine, as a Pipeline's do; the greedy branch is checked
against a plain Pipeline run.
"""

from __future__ import annotations

import argparse
import dataclasses

from pipeline import Metrics, Pipeline, Request, load_model
from pipeline.cli.assemble import embedded_example
from pipeline.tiny import default_model_dir
from stages import DecodeLoop, Prefill, Sampler, Tokenize, VisionEncoder

TEXT_PROMPT = "Write a short poem about the sea."  # the default prompt for a model other than the embedded one


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory or hub id (default: the embedded tiny model)")
    parser.add_argument("--prompt", help="the prompt (default: the embedded model's own question, or a text prompt)")
    parser.add_argument(
        "--image", help="an image for the prompt (default: the embedded model's example image; '' for none)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = str(default_model_dir())
        image, question = embedded_example()
        args.image = image if args.image is None else args.image
        args.prompt = question if args.prompt is None else args.prompt
    args.prompt = TEXT_PROMPT if args.prompt is None else args.prompt
    return args


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Run the example; returns each branch's text (the greedy one checked against a plain run)."""
    args = parse_args(argv)
    lm = load_model(args.model)
    pipe = Pipeline(lm, {})  # no stages: we drive them ourselves, with the pipeline's context and timing
    request = Request(prompt=args.prompt, images=[args.image] if args.image else [], max_new_tokens=args.max_new_tokens)
    print(f"prompt: {args.prompt!r}" + (f" about {args.image}" if args.image else ""))

    ctx = pipe.context(request)
    ctx.metrics.start()
    with ctx.metrics.span("tokenize"):
        Tokenize()(ctx)
    vision = VisionEncoder()
    if not vision.skip(ctx):  # the image's embeddings written over its placeholder tokens
        with ctx.metrics.span("vision_encoder"):
            vision(ctx)
    with ctx.metrics.span("prefill"):
        Prefill()(ctx)
    prefix = ctx.cache.snapshot()  # the prompt's KV, to come back to
    print(f"prefilled once: {ctx.cache.length} tokens, {ctx.cache.nbytes:,} bytes of KV")

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

    plain = {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()}
    reference = Pipeline(lm, plain).run(request)
    assert reference.token_ids == branches["greedy"].generated, "greedy branch differs from a plain run"
    print("greedy branch == plain pipeline run: OK")
    return {name: branch.text for name, branch in branches.items()}


if __name__ == "__main__":
    main()
