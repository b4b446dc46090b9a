"""Random-weight Llama-shaped model folders for size benchmarks (the default model's tokenizer and vocabulary).

    python -m bench.shapes smollm2-1.7b [--out DIR] [--dtype bfloat16]

Writes config.json, model.safetensors (random normal * 0.02, tensor by tensor: never the whole model in memory) and
the default model's tokenizer files into DIR (default: $TOKENSPOUT_CACHE/shapes/<name>-<dtype>), and prints DIR.
Shapes: SmolLM2-360M and SmolLM2-1.7B as published, Llama-3.1-8B's layer shape, and Qwen3-0.6B's (a Qwen3 model:
per-head q / k RMSNorm, head_dim 128 where hidden / heads is 64), all with the default vocabulary; and `tiny` (two
layers 64 wide, for bench.frontend).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                     "num_attention_heads": 15, "num_key_value_heads": 5, "tie_word_embeddings": True},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": True},
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    # (bench.frontend: a small forward, the same in every tree, so what differs is the serving path)
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "tie_word_embeddings": True},
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
                   "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
}


def make(name: str, out: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    from tokenspout.models.default_model import default_model_path

    src = Path(default_model_path())
    base = json.loads((src / "config.json").read_text())
    base.pop("head_dim", None)
    cfg = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPES[name],
           "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch.")}
    done = out / "model.safetensors"
    if done.is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(seed)
    e, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or e // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": rnd(v, e), "model.norm.weight": torch.ones(e, dtype=dtype)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rnd(v, e)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if cfg["model_type"] == "qwen3":
            tensors |= {p + "self_attn.q_norm.weight": torch.ones(d, dtype=dtype),
                        p + "self_attn.k_norm.weight": torch.ones(d, dtype=dtype)}
        tensors |= {p + "self_attn.q_proj.weight": rnd(q, e), p + "self_attn.k_proj.weight": rnd(kv, e),
                    p + "self_attn.v_proj.weight": rnd(kv, e), p + "self_attn.o_proj.weight": rnd(e, q),
                    p + "mlp.gate_proj.weight": rnd(inter, e), p + "mlp.up_proj.weight": rnd(inter, e),
                    p + "mlp.down_proj.weight": rnd(e, inter), p + "input_layernorm.weight": torch.ones(e, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(e, dtype=dtype)}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(done)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    from tokenspout.models.default_model import cache_dir

    out = args.out or cache_dir() / "shapes" / f"{args.name}-{args.dtype}"
    print(make(args.name, out, getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
