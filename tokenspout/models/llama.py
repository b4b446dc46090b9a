"""Llama-family decoder (Llama, Mistral, Qwen2 with QKV bias, Qwen3 with per-head q/k RMSNorm) over a flat batch.

Input is the step's flat token list (every scheduled token of every request concatenated, no padding) with its
positions; attention reads/writes the paged KV cache through AttentionMetadata.  Q/K/V and gate/up projections are
fused at load time (one GEMM each).  `compute_logits` is applied by the runner to the last position of each request
only (DESIGN invariant 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenspout.checks import is_int
from tokenspout.models.attention import AttentionMetadata, paged_attention, write_kv


@dataclass(slots=True)
class LlamaArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf) -> LlamaArch:
        _check_config(hf)
        arch = (hf.architectures or ["LlamaForCausalLM"])[0]
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        qkv_bias = bool(getattr(hf, "attention_bias", False)) or arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
        )


# The sizes a config must give as integers >= 1 (a crafted file's zero heads divided by zero, a string for a count
# failed deep in transformers)
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "max_position_embeddings")


def _positive_int(name: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"model config: {name} must be an integer >= 1, got {value!r}")
    return value


def _check_config(hf) -> None:
    """The config's sizes, before anything divides by them or builds a model of them: a query-head count that the
    key / value heads do not divide gave silent garbage (the kernels' group size rounds down), an odd head_dim a
    crash at the first request (rotary halves)."""
    for name in _SIZES:
        _positive_int(name, getattr(hf, name, None))
    heads = hf.num_attention_heads
    kv = _positive_int("num_key_value_heads", getattr(hf, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise ValueError(f"model config: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"model config: the head dimension must be an even integer (rotary embedding), got "
                         f"{head_dim!r} (head_dim, or hidden_size / num_attention_heads)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like transformers, scale in the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Precomputed cos/sin table for every position; rows are gathered by the step's positions."""

    cos: torch.Tensor  # [max_pos, D/2] buffers (register_buffer: typed here, nn.Module's stubs cannot know them)
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_pos: int):
        super().__init__()
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [max_pos, D/2]
        self.register_buffer("cos", (freqs.cos() * attention_scaling), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved ("rotate half") RoPE on [T, H, D] with cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: LlamaArch):
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.scale = a.head_dim**-0.5

    def forward(self, x, cos, sin, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv, self.head_dim)
        v = v.view(t, self.num_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # (qk_norm sets both)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, a: LlamaArch):
        super().__init__()
        self.inter = a.intermediate_size
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArch):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, a: LlamaArch):
        super().__init__()
        self.arch = a
        # An explicit (uninitialised) weight skips Embedding's random init: the loader overwrites it anyway, and on
        # the meta device normal_ imports torch._dynamo (~1.5 s of start-up).
        # (nn.Module: a GGUF's quantized model looks rows up in the file instead, models/gguf_model.GGUFEmbedding)
        self.embed_tokens: nn.Module = nn.Embedding(a.vocab_size, a.hidden_size,
                                                    _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList([DecoderLayer(a) for _ in range(a.num_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary: Rotary | None = None  # set by the loader (built outside the meta-device context)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        num_layers: int | None = None,  # run only the first layers (self-draft speculative decoding)
    ) -> torch.Tensor:
        assert self.rotary is not None, "the loader sets the rotary table"
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer, kv in zip(layers, kv_caches, strict=False):
            x = layer(x, cos, sin, kv, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + vocab projection of the selected rows only; logits in float32."""
        return self.lm_head(self.norm(hidden)).float()
