"""A linear layer that holds only its quantized weight (models/quantize.PackedWeight) and runs through the C kernels.

With `--quantization` on a CPU where the kernels load, every nn.Linear of the model is replaced by one of these:
the weights are held once, as packed codes + float16 scales (and mins), with no dequantized float copy beside them
(the float copy was 4 bytes per weight next to 0.625-1.06: ~6.8 GB of a 1.7B model).  Steps the C decoder takes
whole never call it; the torch model calls it for what the decoder leaves (steps above its token limit, prompt
logprobs over many rows, Qwen3's q/k-norm layers), and the kernels' tiled path serves any number of rows.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspout.kernels import cpu
from tokenspout.models.quantize import PackedWeight


class QuantLinear(nn.Module):
    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, lib):
        super().__init__()
        self.packed, self.lib = packed, lib  # plain attributes: not part of state_dict (the cache stores them apart)
        self.in_features, self.out_features = packed.k, packed.n
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._bias32: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if self.bias is not None and self._bias32 is None:  # the kernels take a float32 bias
            self._bias32 = self.bias.detach().float().contiguous()
        out = cpu.linear(self.lib, x2, self.packed, self._bias32)
        return out.view(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, wt={self.packed.wt}"


def replace_linears(model: nn.Module, packed: dict[str, PackedWeight], lib) -> None:
    """Swaps each nn.Linear named in `packed` for a QuantLinear of its packed weight (bias kept); the float weight is
    dropped.  A tied LM head is untied first (the embedding keeps the exact float values)."""
    for name, pw in packed.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        setattr(parent, child, QuantLinear(pw, old.bias.data if old.bias is not None else None, lib))


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(out, in) of every nn.Linear or QuantLinear, by module name."""
    return {name: (m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, QuantLinear))}
