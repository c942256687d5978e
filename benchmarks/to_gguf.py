"""Convert a Llama-architecture ``save_pretrained`` directory to GGUF for llama.cpp, with the
``gguf`` package (the writer llama.cpp's own ``convert_hf_to_gguf.py`` uses), so that a
side-by-side runs the same weights (``benchmarks/vs_llama_cpp.py``).

Only what the benchmark needs: Llama's tensors (queries and keys permuted to llama.cpp's rotary
layout, as ``convert_hf_to_gguf.py`` does), its hyper-parameters, and the vocabulary as plain
placeholder pieces (the benchmark feeds token ids, never text).

    python benchmarks/to_gguf.py MODEL_DIR out.gguf --dtype bf16     # or f32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

NAMES = {  # transformers' Llama tensor names -> GGUF's
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    _, _, index, rest = name.split(".", 3)  # model.layers.N.<module>.weight
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{LAYER[module]}.{kind}"


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' rotate-half rotary layout -> llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(model_dir: Path, out: Path, dtype: str = "bf16") -> Path:
    import gguf
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise SystemExit(f"to_gguf: only Llama-architecture models (got {config.get('model_type')})")
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    if "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(
        float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    )
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bf16" else gguf.LlamaFileType.ALL_F32)
    vocab = config["vocab_size"]
    w.add_tokenizer_model("llama")  # a SentencePiece-style list of placeholder pieces: ids are what count
    w.add_token_list([f"<0x{i:02X}>" if i < 256 else f"\u2581t{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.BYTE if i < 256 else gguf.TokenType.NORMAL for i in range(vocab)])
    eos = config.get("eos_token_id")
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else (eos if eos is not None else vocab - 1))
    w.add_bos_token_id(config.get("bos_token_id") or 0)
    for name, t in tensors.items():
        t = t.float()
        if name.endswith("q_proj.weight"):
            t = permute(t, heads)
        elif name.endswith("k_proj.weight"):
            t = permute(t, kv_heads)
        matrix = t.dim() == 2
        if dtype == "bf16" and matrix:
            bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(gguf_name(name), bits, raw_shape=bits.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:  # norms stay float32, as llama.cpp's converter keeps them
            w.add_tensor(gguf_name(name), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    args = ap.parse_args(argv)
    convert(args.model_dir, args.out, args.dtype)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
