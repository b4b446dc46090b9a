"""Attention over the paged KV cache for one flat batch (prefill and decode tokens mixed).

The KV cache of a layer is one tensor [2, num_slots, num_kv_heads, head_dim] (num_slots = num_blocks * block_size),
in the model's dtype or float16 (--kv-cache-dtype; values are rounded when written and widened when read);
a token's slot is block_table[pos // block_size] * block_size + pos % block_size.  The model runner builds an
AttentionMetadata once per step; every layer reuses it:

* all decode requests (query length 1) are batched into one call: with the C kernels (kernels/cpu.py) they read
  the cache in place through the padded [num_decodes, max_blocks] block table; otherwise one SDPA call over keys
  gathered block by block (index_select of whole blocks, ~6x faster than gathering token slots with advanced
  indexing) with a validity mask over the padded length;
* each request with a longer query (prefill chunk) gets its own SDPA call with a causal mask offset by the tokens
  already in its cache.  Prefills are few per step (the token budget bounds them), so this loop is short.

GQA without repeating K/V: the query heads that share a KV head are folded into the query-length axis
([.., num_kv_heads, group * q_len, head_dim]), so SDPA sees plain multi-head attention against num_kv_heads heads.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # first row of this request's tokens in the flat batch
    token_end: int
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] the request's blocks holding positions 0..ctx_len-1
    ctx_len: int  # cached positions after this chunk is written (includes the chunk)
    mask: torch.Tensor  # [group * q_len, ctx_len] bool, True = attend (causal, offset by ctx_len - q_len)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    block_size: int
    num_decode_tokens: int  # decode tokens come first in the flat batch, one per request
    decode_block_ids: torch.Tensor | None  # [num_decodes * max_blocks] flattened padded block table
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int64, for the C kernel
    kernels: ctypes.CDLL | None = None  # the C kernel library (kernels/cpu.py), or None for SDPA


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The cache may be narrower than the model (--kv-cache-dtype float16): values are rounded on the way in."""
    kv_cache[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    num_kv = kv_cache.shape[2]
    group = num_heads // num_kv
    out = torch.empty_like(q)
    blocks = kv_cache.view(2, -1, meta.block_size, num_kv, head_dim)  # the same memory, block-major
    nd = meta.num_decode_tokens
    if nd:
        block_ids = meta.decode_block_ids
        assert block_ids is not None, "decode tokens without their block table"
        if meta.kernels is not None:
            assert meta.decode_seq_lens is not None, "the C kernel reads the decodes' sequence lengths"
            qd = q[:nd].contiguous()
            meta.kernels.ts_attn_decode(qd.data_ptr(), num_heads * head_dim, kv_cache.data_ptr(), kv_cache.shape[1],
                                        block_ids.data_ptr(), block_ids.numel() // nd,
                                        meta.decode_seq_lens.data_ptr(), meta.block_size, nd, num_heads, num_kv,
                                        head_dim, scale, out.data_ptr(), num_heads * head_dim,
                                        int(kv_cache.dtype == torch.float16))
        else:
            k = blocks[0].index_select(0, block_ids).view(nd, -1, num_kv, head_dim).transpose(1, 2).to(q.dtype)
            v = blocks[1].index_select(0, block_ids).view(nd, -1, num_kv, head_dim).transpose(1, 2).to(q.dtype)
            qd = q[:nd].view(nd, num_kv, group, head_dim)  # [R, Hkv, G, D]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
            out[:nd] = o.reshape(nd, num_heads, head_dim)
    for p in meta.prefills:
        ql = p.token_end - p.token_start
        k = blocks[0].index_select(0, p.block_ids).view(-1, num_kv, head_dim)[: p.ctx_len].to(q.dtype)
        v = blocks[1].index_select(0, p.block_ids).view(-1, num_kv, head_dim)[: p.ctx_len].to(q.dtype)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        # [ql, H, D] -> [Hkv, G*ql, D]: head h = kv*G + g
        qp = q[p.token_start : p.token_end].view(ql, num_kv, group, head_dim).permute(1, 2, 0, 3)
        qp = qp.reshape(1, num_kv, group * ql, head_dim)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, scale=scale)
        o = o.view(num_kv, group, ql, head_dim).permute(2, 0, 1, 3).reshape(ql, num_heads, head_dim)
        out[p.token_start : p.token_end] = o
    return out


def causal_mask(q_len: int, ctx_len: int, group: int, device: torch.device) -> torch.Tensor:
    """[group * q_len, ctx_len]: query i (absolute position ctx_len - q_len + i) sees keys 0..its position."""
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    kpos = torch.arange(ctx_len, device=device)
    m = kpos[None, :] <= qpos[:, None]
    return m.repeat(group, 1)
