"""A quantized model built straight from its checkpoint, one linear layer at a time, with no float copy of the model.

Where the C kernels run (`--quantization int4 | int8`), each linear layer's checkpoint tensors are read (one tensor
at a time, see checkpoint.CheckpointReader), rounded to the model dtype, quantized 1024 rows at a time and packed;
the float rows are dropped before the next layer is read.  Only the embedding, the norms and the biases are
allocated as float tensors (and from a GGUF file not even the embedding: gguf_model.GGUFEmbedding reads its rows
from the file).  The peak memory of a first start is then the packed model + the embedding + one layer's float
tensors, where quantizing a loaded float model first held the whole float model (4 bytes per weight:
~6.8 GB of a 1.7B model, more than its packed form + KV cache).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tokenspout.models.llama import LlamaForCausalLM
from tokenspout.models.checkpoint import copy_rows, open_checkpoint, weight_plan
from tokenspout.models.quant_linear import linear_shapes, replace_linears
from tokenspout.models.quantize import PackedWeight, check_quantizable, linear_format, quantize_rows, quantizer


def build_quantized(meta: LlamaForCausalLM, path: Path, method: str, dtype: torch.dtype, lib,
                    finish: Callable[[LlamaForCausalLM], LlamaForCausalLM]
                    ) -> tuple[LlamaForCausalLM, dict[str, PackedWeight]]:
    """The model of the checkpoint in `path` with QuantLinear layers (`method`, over `lib`); `meta`: the model built
    on the meta device (its linear layers are replaced); `finish`: the loader's last step (rotary table, dtype)."""
    plan = weight_plan(meta.arch)
    reader = open_checkpoint(path)
    exact = getattr(reader, "packed", None)  # a GGUF's blocks that fit a kernel format convert without re-rounding
    shapes = linear_shapes(meta)
    packed: dict[str, PackedWeight] = {}
    for name, (n, k) in shapes.items():
        check_quantizable(name, k, method)
        keys = plan.get(name + ".weight", ["embed_tokens.weight"])  # a tied LM head is the embedding
        shapes_in = [reader.shape(key) for key in keys]
        if (sum(s[0] for s in shapes_in), *shapes_in[0][1:]) != (n, k) or any(s[1:] != shapes_in[0][1:]
                                                                              for s in shapes_in):
            shown = " + ".join(str(s) for s in shapes_in)
            raise ValueError(f"tensor {name}.weight has shape {shown}, expected {(n, k)}")
        fmt = linear_format(name, method)
        pw = exact(keys, fmt, lib) if exact is not None else None
        if pw is None:
            rows = getattr(reader, "rows", reader.get)  # (a GGUF's: dequantized a chunk at a time)
            pw = quantize_rows([rows(key) for key in keys], quantizer(fmt, lib), dtype)
        packed[name] = pw
    replace_linears(meta, packed, lib)
    model = meta.to_empty(device="cpu")
    own = dict(model.named_parameters())
    for pname, keys in plan.items():
        if pname.endswith(".weight") and pname.removesuffix(".weight") in shapes:
            continue
        if pname == "embed_tokens.weight" and not isinstance(model.embed_tokens, torch.nn.Embedding):
            continue  # the embedding reads its rows itself (a GGUF's, gguf_model.GGUFEmbedding)
        copy_rows(own, pname, [reader.get(key) for key in keys])
    reader.warn_unused(plan)
    return finish(model), packed
