"""Qwen2-VL-2B in nf4 through the pipeline: weight bytes, peak memory, TTFT, decode tokens/s.

Why this exists: the 4-bit path is the default way real models load on a GPU (quant=auto),
and its cost/benefit only shows at real size. No download is needed: the script builds the
real Qwen2-VL-2B-Instruct architecture from its published config values (written below)
with random weights, saves it with ``save_pretrained`` to a temp folder, loads it back
through ``pipeline.load_model(quant=...)`` (transformers + accelerate + bitsandbytes, the
same code the CLI uses) and runs one image prompt through the stage chain.

Random weights make the text meaningless but the work identical: same shapes, same kernels,
same number of tokens (``ignore_eos``). The tokenizer is the project's small byte-level one
(the real one cannot be downloaded); the vocabulary *size* of the model stays 151,936, so
the embedding and lm_head cost what they really cost.

Usage (GPU):   python benchmarks/gpu_qwen2vl_nf4.py [--quant nf4|fp4|int8|none] [--runs 3]
CPU check:     python benchmarks/gpu_qwen2vl_nf4.py --layers 2 --vision-depth 2 --image-size 224 \\
                   --max-new-tokens 8 --runs 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from archs import QWEN2_VL_2B_TEXT, QWEN2_VL_2B_VISION, build_qwen2_vl_2b  # noqa: E402


def test_image(size: int):
    """A deterministic, non-uniform RGB picture (content does not matter, its size does)."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB")


def cold_run(pipe, request) -> dict:
    """One timed run as a first request sees it: the prefix cache emptied, so the image is
    encoded and the whole prompt prefilled again (a repeat would find both cached, and time a
    lookup: vision 0.0002 s)."""
    pipe.pool.clear_prefix_cache()
    return pipe.run(request).metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="nf4", choices=["nf4", "fp4", "int8", "none"])
    ap.add_argument("--layers", type=int, default=QWEN2_VL_2B_TEXT["num_hidden_layers"], help="shrink to check on CPU")
    ap.add_argument("--vision-depth", type=int, default=QWEN2_VL_2B_VISION["depth"], help="shrink to check on CPU")
    ap.add_argument("--image-size", type=int, default=448, help="square image side in pixels (448 -> 256 tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="measured runs after one warm-up")
    ap.add_argument("--device-map", default=None, help="model.device_map (default: the GPU, or cpu)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    from pipeline import Pipeline, Request, load_model
    from pipeline.model.loading import format_placement
    from stages import DecodeLoop, Prefill, Sampler, Tokenize
    from stages.vision_encoder import VisionEncoder

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="qwen2vl-2b-"))
    try:
        t0 = time.perf_counter()
        build_qwen2_vl_2b(tmp, device, args.layers, args.vision_depth)
        print(
            f"built random-weight Qwen2-VL-2B ({args.layers} layers, vision depth {args.vision_depth}) "
            f"in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        lm = load_model(str(tmp), quant=args.quant, device_map=args.device_map)
        load_s = time.perf_counter() - t0
        load_peak = int(torch.cuda.max_memory_allocated()) if cuda else None
        print(f"loaded quant={lm.quant} in {load_s:.1f} s\n{format_placement(lm.placement)}", file=sys.stderr)

        pipe = Pipeline(
            lm,
            {
                "tokenize": Tokenize(),
                "vision_encoder": VisionEncoder(),
                "prefill": Prefill(),
                "decode": DecodeLoop(Sampler()),
            },
        )
        request = Request(
            prompt="Describe this image in detail.",
            images=[test_image(args.image_size)],
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
        )
        pipe.run(request)  # warm-up: CUDA context, kernels, allocator
        runs = [cold_run(pipe, request) for _ in range(max(1, args.runs))]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def mean_sd(key: str) -> tuple[float, float]:
        values = [m[key] for m in runs if m.get(key) is not None]
        return (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0) if values else (0.0, 0.0)

    last = runs[-1]
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "quant": lm.quant,
        "text_layers": args.layers,
        "vision_depth": args.vision_depth,
        "image_tokens": last.get("image_tokens"),
        "prompt_tokens": last["prompt_tokens"],
        "generated_tokens": last["generated_tokens"],
        "weights_bytes": lm.weights_bytes,
        "placement": lm.placement,
        "load_s": load_s,
        "load_peak_memory_bytes": load_peak,
        "peak_memory_bytes": max(m["peak_memory_bytes"] for m in runs),  # without the KV pool
        "kv_pool_bytes": last.get("kv_pool_bytes"),
        "kv_cache_bytes": last["kv_cache_bytes"],
        "ttft_s": mean_sd("ttft_s"),
        "prefill_tok_s": mean_sd("prefill_tok_s"),
        "decode_tok_s": mean_sd("decode_tok_s"),
        "bandwidth_gb_s": mean_sd("bandwidth_gb_s"),
        "runs": len(runs),
    }
    vision = [m["stages"].get("vision_encoder", {}).get("seconds", 0.0) for m in runs]
    report["vision_s"] = (statistics.mean(vision), statistics.stdev(vision) if len(vision) > 1 else 0.0)
    gib = 2**30
    print(
        f"\nQwen2-VL-2B random weights, quant={report['quant']} on {report['device']} "
        f"({report['runs']} runs after a warm-up; mean ± sd)"
    )
    print(f"  weights            {report['weights_bytes'] / gib:.3f} GiB")
    print(
        f"  peak memory        {report['peak_memory_bytes'] / gib:.3f} GiB"
        + ("  (CUDA allocated" if cuda else "  (process RSS")
        + ", without the KV pool)"
    )
    print(f"  KV pool            {(report['kv_pool_bytes'] or 0) / gib:.3f} GiB")
    print(f"  prompt / image     {report['prompt_tokens']} tokens, {report['image_tokens']} image tokens")
    for key, unit in (
        ("ttft_s", "s"),
        ("vision_s", "s"),
        ("prefill_tok_s", "tok/s"),
        ("decode_tok_s", "tok/s"),
        ("bandwidth_gb_s", "GB/s"),
    ):
        mean, sd = report[key]
        print(f"  {key:<18} {mean:.4g} ± {sd:.2g} {unit}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
