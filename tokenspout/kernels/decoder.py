"""A step through the C kernels: every decoder layer of the step's tokens in one call.

Used by the model runner for a step of at most `max_tokens` tokens (a quantized model's steps of any size, prompt
chunks included; a float32 model's of up to MAX_TOKENS) on a model whose shapes the kernels take (K dims and
head_dim multiples of 8; Qwen3's per-head q / k RMSNorm included).  Everything else runs the torch model: both paths
read and write the same paged KV cache, so a request moves between them freely from step to step.

With quantized weights (ModelConfig.quantization, models/quantize.py) the kernels stream the packed codes; where
they run, the torch model's linear layers are QuantLinear modules over the same packed weights (no float copy), so
both paths compute with the same effective weights and differ only in summation order.
"""

from __future__ import annotations

import ctypes
import sys
from typing import TYPE_CHECKING

import torch

from tokenspout.kernels import cpu
from tokenspout.models.llama import DecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from tokenspout.models.loader import LoadedModel

# Up to this many tokens a step runs through the kernels (larger: the torch model, MKL GEMMs).  Measured on this
# 2-core AVX2 machine (offline generation, one core): the float32 row-streaming kernel still beat MKL at 64 decode
# tokens (128 vs 117 tok/s).  Quantized weights run with int16 activations (integer dot products, the codes unpacked
# once per block for every row), which beat float32 at every batch size measured: 1.6x at one row, 1.2-1.6x at
# 16-128 rows (168 tok/s at 128 rows on one core), so quantized models keep larger steps in the kernels.  With the
# tiled path for 16+ rows (csrc/decode_cpu.c) they beat the torch model's MKL float32 GEMMs on whole prefill steps
# too (in-process, 2 threads: a 400-token prompt 733 -> 534 ms; 1,500 tokens in chunks of 512 equal, 3.0 s, where
# the kernels' token-by-token attention over the longer context catches up), and a served c=64 run keeps its
# prefill chunks there (TTFT p50 1.1-1.2 s -> 0.6-0.8 s), so up to the default step budget runs in the kernels.
# Larger steps (`--max-num-batched-tokens` above 512) ran the torch model: prefill of 1,024 / 4,096 prompt tokens
# (default model, int4, in process) in steps of 1,024 or 2,048 tokens took 2.4-2.6 / 14.2-17.3 s against 1.8 / 9.8-10.2
# in steps of 512.  In the kernels as one call they took 2.2-2.6 / 13.0-15.2 s at 2,048 (a step's intermediate
# activations, 25 KB a token for this model, outgrow the caches), in slices of 512 1.7-2.0 / 9.9-12.0 (steps of 512
# the same runs: 1.7-2.1 / 9.8-12.1; slices of 256 alike).  So the kernels take a quantized model's steps of any
# size, in slices of SLICE_TOKENS run one after the other (a slice's tokens attend to the K / V the slices before it
# wrote, as a later step's would).
MAX_TOKENS = 64
QUANTIZED_MAX_TOKENS = sys.maxsize
SLICE_TOKENS = 512
# forward_logits keeps its [T, vocab] float32 output between steps up to this many bytes (64 clients x a 128k
# vocabulary fit); larger ones (long prompts scored whole) are allocated per step.
LOGITS_KEPT = 48 << 20


def build(loaded: LoadedModel, kv_caches: list[torch.Tensor], block_size: int, num_layers: int | None = None,
          invariant: bool = False) -> CpuDecoder | None:
    """The C decoder for a loaded model where this CPU and model take the kernels, else
    None.  invariant (--batch-invariant): the kernels' batch-invariant build, running every step however large; a
    ValueError where it cannot run."""
    if not supported(loaded.model, loaded.dtype):
        if invariant:
            raise ValueError("--batch-invariant needs the C kernels, which this model does not take: float32 "
                             "compute (--dtype float32 or auto), hidden / intermediate / head sizes multiples of 8")
        return None
    lib = cpu.load(invariant=invariant)
    if lib is None:
        if invariant:
            raise ValueError("--batch-invariant needs the C kernels: a CPU with AVX2, FMA and F16C and a C compiler "
                             "(gcc), and TOKENSPOUT_KERNELS not 0")
        return None
    return CpuDecoder(lib, loaded.model, kv_caches, block_size, loaded.quantized, num_layers, unbounded=invariant)


def supported(model: LlamaForCausalLM, dtype: torch.dtype) -> bool:
    a = model.arch
    dims = (a.hidden_size, a.intermediate_size, a.num_heads * a.head_dim, a.head_dim)
    return dtype == torch.float32 and all(d % 8 == 0 for d in dims)


class CpuDecoder:
    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 quantized: dict | None = None, num_layers: int | None = None, unbounded: bool = False):
        """num_layers: run only the first layers (self-draft speculative decoding); unbounded: take steps of any
        size (--batch-invariant: no step goes to the torch model, whose summation orders differ)."""
        self.lib, self.model = lib, model
        a = model.arch
        self.arch = a
        q = quantized or {}
        self._keep: list[object] = []  # every tensor whose address the C struct holds stays alive here

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            assert t.is_contiguous() and t.dtype == torch.float32
            self._keep.append(t)
            return t.data_ptr()

        def cache_ptr(kv: torch.Tensor) -> int:
            """A layer's KV cache: float32, or float16 in every layer (--kv-cache-dtype float16)."""
            assert kv.is_contiguous() and kv.dtype in (torch.float32, torch.float16) and kv.dtype == kv_caches[0].dtype
            return kv.data_ptr()

        def weight(name: str, module, quant: bool) -> cpu.Weight:
            w = q[name] if quant and name in q else module.weight.data
            self._keep.extend([w] if isinstance(w, torch.Tensor) else w.tensors())
            desc = cpu.weight(w)[0]
            self._keep.append(desc)  # (its tail descriptor, which the layer's copy points to, lives as long)
            return desc

        n = num_layers or a.num_layers
        slots = kv_caches[0].shape[1]
        rotary = model.rotary
        assert rotary is not None, "the loader sets the rotary table before the decoder is built"

        def descriptor(quant: bool) -> cpu.Model:
            layers = (cpu.Layer * n)()
            for i, (layer, kv) in enumerate(zip(model.layers[:n], kv_caches[:n])):
                assert isinstance(layer, DecoderLayer)  # (nn.ModuleList items are typed as Module)
                p = f"layers.{i}."
                att, mlp = layer.self_attn, layer.mlp
                bias = att.qkv_proj.bias.data if att.qkv_proj.bias is not None else None
                qn, kn = att.q_norm, att.k_norm  # (Qwen3; None elsewhere)
                layers[i] = cpu.Layer(
                    ptr(layer.input_layernorm.weight.data), ptr(layer.post_attention_layernorm.weight.data),
                    weight(p + "self_attn.qkv_proj", att.qkv_proj, quant),
                    weight(p + "self_attn.o_proj", att.o_proj, quant),
                    weight(p + "mlp.gate_up_proj", mlp.gate_up_proj, quant),
                    weight(p + "mlp.down_proj", mlp.down_proj, quant), ptr(bias), cache_ptr(kv),
                    ptr(qn.weight.data if qn is not None else None), ptr(kn.weight.data if kn is not None else None))
            self._keep.append(layers)
            return cpu.Model(n, a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
                             a.head_dim, slots, block_size, a.rms_norm_eps, a.head_dim**-0.5, layers,
                             ptr(rotary.cos.contiguous()), ptr(rotary.sin.contiguous()),
                             int(kv_caches[0].dtype == torch.float16))

        # quantized models stream their packed codes at every batch size; float32 ones their float32 weights
        self.desc = descriptor(bool(q))
        self.max_tokens = sys.maxsize if unbounded else QUANTIZED_MAX_TOKENS if q else MAX_TOKENS
        self.lm_head = q["lm_head"] if "lm_head" in q else model.lm_head.weight.data
        # the final norm and the LM head as ts_decode_layers takes them (forward_logits)
        self._norm = ptr(model.norm.weight.data)
        self._lm_desc, self.vocab_size = cpu.weight(self.lm_head)  # (self.lm_head keeps its tensors alive)
        self.scratch_per_token = ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim
                                  + a.num_heads * a.head_dim + 3 * a.intermediate_size)
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._logits = torch.empty(0, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_ids: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm) for T decode tokens;
        block_ids [T, nb] int64 contiguous, seq_lens [T] = positions + 1."""
        return self._layers(input_ids, positions, slot_mapping, block_ids, seq_lens, None)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       block_ids: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward's hidden states, logits(hidden)) in one call of the kernels (one parallel region: see
        ts_decode_layers), for steps whose every token samples; at most max_tokens tokens."""
        t = input_ids.shape[0]
        assert t <= self.max_tokens
        need = t * self.vocab_size
        if need <= LOGITS_KEPT // 4:
            # Kept between steps like the scratch: a fresh [T, vocab] buffer of a few MB is fresh pages from the
            # OS every step, and faulting them in as the LM head writes its logits was ~5% of the served engine's
            # CPU at 64 clients (perf).  The runner is done with a step's logits when its run() returns.
            if self._logits.numel() < need:
                self._logits = torch.empty(need, dtype=torch.float32)
            logits = self._logits[:need].view(t, self.vocab_size)
        else:
            logits = torch.empty(t, self.vocab_size, dtype=torch.float32)
        return self._layers(input_ids, positions, slot_mapping, block_ids, seq_lens, logits), logits

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_ids: torch.Tensor, seq_lens: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        t = input_ids.shape[0]
        if t > SLICE_TOKENS:  # in order: each slice's tokens see the K / V the slices before it wrote
            return torch.cat([self._layers(input_ids[s:s + SLICE_TOKENS], positions[s:s + SLICE_TOKENS],
                                           slot_mapping[s:s + SLICE_TOKENS], block_ids[s:s + SLICE_TOKENS],
                                           seq_lens[s:s + SLICE_TOKENS],
                                           logits[s:s + SLICE_TOKENS] if logits is not None else None)
                              for s in range(0, t, SLICE_TOKENS)])
        x = self.model.embed_tokens(input_ids).contiguous()
        need = t * self.scratch_per_token
        if self._scratch.numel() < need:  # kept between steps: a fresh buffer is fresh pages, faulted in every step
            self._scratch = torch.empty(need, dtype=torch.float32)
        scratch = self._scratch
        lm = (self._norm, ctypes.byref(self._lm_desc), self.vocab_size, logits.data_ptr()) if logits is not None \
            else (None, None, 0, None)
        self.lib.ts_decode_layers(ctypes.byref(self.desc), x.data_ptr(), t, positions.data_ptr(),
                                  slot_mapping.data_ptr(), block_ids.data_ptr(), block_ids.shape[1],
                                  seq_lens.data_ptr(), scratch.data_ptr(), *lm)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + vocabulary projection of the selected rows (float32)."""
        n = hidden.shape[0]
        if n > self.max_tokens:
            return self.model.compute_logits(hidden)
        h = torch.empty(hidden.shape, dtype=torch.float32)
        hidden = hidden.contiguous()
        self.lib.ts_rmsnorm(hidden.data_ptr(), hidden.shape[0], hidden.shape[1],
                            self.model.norm.weight.data.data_ptr(), self.arch.rms_norm_eps, h.data_ptr())
        return cpu.linear(self.lib, h, self.lm_head)
