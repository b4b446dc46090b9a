"""The decode kernels against torch references, at every ISA level this CPU has (AVX2, AVX-512 VNNI: each built and
loaded on its own, as TOKENSPOUT_ISA would force it) and in the batch-invariant build (`--batch-invariant`);
skipped where the CPU or compiler cannot build them."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from bench.common import q6k_int6, q6k_raw
from tests.helpers import kernel_levels, kernel_lib, quantize_int5
from tokenspout.kernels import cpu
from tokenspout.models.quantize import dequantize, empty_packed, pack_int5, pack_int8, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="decode kernels unavailable on this machine")


@pytest.fixture(params=[*kernel_levels(), "avx2-invariant"])
def lib(request):
    """Each level this CPU has, each one it lacks on SIMDe's intrinsics (tests.helpers.kernel_levels), and the
    batch-invariant build."""
    return cpu.load(invariant=True) if request.param == "avx2-invariant" else kernel_lib(request.param)


def test_the_best_level_is_chosen_and_can_be_forced(monkeypatch):
    have = cpu.available_isas()
    assert cpu.chosen_isa() == have[-1]
    for isa in have:
        monkeypatch.setenv("TOKENSPOUT_ISA", isa)
        assert cpu.chosen_isa() == isa
    monkeypatch.setenv("TOKENSPOUT_ISA", "sse2")
    with pytest.raises(ValueError, match="TOKENSPOUT_ISA must be one of"):
        cpu.chosen_isa()
    for isa in [isa for isa in cpu.ISA_LEVELS if isa not in have]:  # an AVX2-only CPU: forcing AVX-512 says why not
        monkeypatch.setenv("TOKENSPOUT_ISA", isa)
        with pytest.raises(ValueError, match="lacks"):
            cpu.chosen_isa()


@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("n", [37, 96])
def test_linear_float32_matches_torch(lib, m, n):
    g = torch.Generator().manual_seed(m * 100 + n)
    x, w, b = torch.randn(m, 72, generator=g), torch.randn(n, 72, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(cpu.linear(lib, x, w), x @ w.T, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu.linear(lib, x, w, bias=b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    y = torch.randn(m, n, generator=g)
    torch.testing.assert_close(cpu.linear(lib, x, w, out=y.clone(), accumulate=True), y + x @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 31, 33, 64, 70])
@pytest.mark.parametrize("n", [5, 37, 96])
def test_linear_float_weights_row_and_tiled_paths_match_torch(lib, dtype, m, n):
    """float32 / bfloat16 / float16 weights (16-bit ones widened in registers) against float64 products of the same
    values: the row path below FTILE_MIN (16) rows, the float tiled path from there (odd N: a partial block of
    weight rows; M not a multiple of the tile's batch rows: padding rows), with bias and accumulation."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, b = torch.randn(m, 136, generator=g), torch.randn(n, generator=g)
    w = torch.randn(n, 136, generator=g).to(dtype)
    ref = x.double() @ w.double().T
    tol = dict(atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(cpu.linear(lib, x, w).double(), ref, **tol)
    torch.testing.assert_close(cpu.linear(lib, x, w, bias=b).double(), ref + b.double(), **tol)
    y = torch.randn(m, n, generator=g)
    got = cpu.linear(lib, x, w, out=y.clone(), accumulate=True)
    torch.testing.assert_close(got.double(), y.double() + ref, **tol)


def int16_activations(x: torch.Tensor, levels: float = 32767.0) -> torch.Tensor:
    """The kernels' activation quantization: per group of 32, codes round(x * L / amax) times amax / L (L = 32767,
    or 127 for int8 activations)."""
    g = x.view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: torch computes `levels / amax` (a scalar over a tensor) as a product with the
    # reciprocal, which differs from the kernels' division in the last bit and moves a code at a half now and then
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / levels)).view_as(x)


def unpack_min(packed) -> torch.Tensor:
    """Q4's per-group mins [N, K/32] from the kernels' block layout."""
    return packed.min.float().view(-1, packed.k // 32, 4).transpose(1, 2).reshape(-1, packed.k // 32)[: packed.n]


@pytest.mark.parametrize("fn,levels", [(quantize_int8, 254), (quantize_int4, 15), (quantize_int5, 31)])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 13, 14, 15, 16, 17, 27, 28, 70])
@pytest.mark.parametrize("n", [5, 64, 130])
@pytest.mark.parametrize("k", [96, 128, 608, 1088])
def test_linear_quantized_packed_matches_dequantized(lib, fn, levels, m, n, k):
    """Quantized weights x int16 activations: exactly the integer dot products of the quantized values, scaled;
    Q4's min term uses the exact float group sums of x.  AVX2: m < 16 takes the row path (m = 15 its largest batch),
    m >= 16 the tiled path: 16 is one tile of 16 rows, 17 a tile of 16 and one of 8 with 7 padding rows, 70 four
    and one; AVX-512: m < 14 the row path (13 its largest), 14 one tile of 16 rows with 2 padding rows, 17 and 28
    one tile of 32 rows with padding rows, 70 two tiles of 32 and one of 16; n = 5 and 130 end on a lone block of four weight rows (the tiled path takes them in pairs) and on
    padding rows; k = 96 ends Q4's pairs of groups with a lone group; k = 608 (19 groups) spans three of the tiled
    path's chunks of widened groups, the last one short and ending on a lone group; int5 comes in triples of
    groups: k = 128 (4 groups) and 608 (19) end on a lone group of a short triple, 1088 (34) on a pair."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    G = k // 32
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    w[0, :32] = 0.0  # an all-zero group must not divide by zero
    x[0, 32:64] = 0.0  # nor an all-zero activation group
    packed, deq = fn(w)
    groups = w.view(n, G, 32)
    span = groups.amax(-1) - groups.amin(-1)
    err = (deq - w).abs().view(n, G, 32).amax(-1)
    # half a grid step, plus the float16 rounding of the scale (and min) both formats store
    assert (err <= 0.51 * span / levels + 2e-3 * groups.abs().amax(-1) + 1e-7).all()
    xq = int16_activations(x).double()
    if packed.min is None:
        ref, mag = xq @ deq.double().T, xq.abs() @ deq.double().abs().T
    else:
        mins = unpack_min(packed).double()
        codes, sums = deq.double() - mins.repeat_interleave(32, 1), x.view(m, G, 32).sum(-1).double()
        ref = xq @ codes.T + sums @ mins.T
        mag = xq.abs() @ codes.abs().T + sums.abs() @ mins.abs().T
    # float32 rounding of the kernels' terms: relative to their magnitudes (Q4's min term cancels most of the code
    # term: results ~1 from terms ~1000), not to the result
    tol = 2e-6 * mag + 1e-5

    def check(got, want):
        assert ((got.double() - want).abs() <= tol).all(), ((got.double() - want).abs() / tol).max()

    b = torch.randn(n, generator=g)
    check(cpu.linear(lib, x, packed), ref)
    check(cpu.linear(lib, x, packed, bias=b), ref + b.double())
    y = torch.randn(m, n, generator=g)
    check(cpu.linear(lib, x, packed, out=y.clone(), accumulate=True), y.double() + ref)
    # and the activation rounding costs little against the float product (a bound, not the oracle)
    assert (cpu.linear(lib, x, packed) - x @ deq.T).abs().max() < 1e-3 * (x @ deq.T).abs().max()


def test_quantization_reproduces_values_already_on_its_grid():
    """Weights that are Q4_1 / Q8_0 values (like the default model's) come back exactly (up to float32 rounding)."""
    g = torch.Generator().manual_seed(1)
    # float16 scales and mins, as the GGUF formats store them
    d, lo = (torch.rand(8, 4, 1, generator=g) * 0.1).half().float(), torch.randn(8, 4, 1, generator=g).half().float()
    q = torch.randint(0, 16, (8, 4, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # Q4_1's min and max elements sit on the ends of the grid
    w4 = (q * d + lo).view(8, 128)
    torch.testing.assert_close(quantize_int4(w4)[1], w4, atol=1e-6, rtol=1e-6)
    q8 = torch.randint(-127, 128, (8, 4, 32), generator=g)
    q8[..., 0] = 127
    w8 = (q8 * d).view(8, 128)
    torch.testing.assert_close(quantize_int8(w8)[1], w8, atol=1e-6, rtol=1e-6)


def test_rmsnorm_matches_reference(lib):
    x, w = torch.randn(3, 64), torch.randn(64)
    out = torch.empty_like(x)
    lib.ts_rmsnorm(x.data_ptr(), 3, 64, w.data_ptr(), ctypes.c_float(1e-5), out.data_ptr())
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("d, lens", [(16, [1, 7, 13]), (64, [8, 16, 9]), (104, [15, 2, 16]), (24, [45, 33, 1]),
                                     (128, [48, 40, 17])])
@pytest.mark.parametrize("hkv", [2, 5])
def test_paged_decode_attention_matches_sdpa(lib, d: int, lens: list[int], dtype: torch.dtype, group: int, hkv: int):
    """GQA over a shuffled block table, ragged lengths (multiples of 8 and not), a partial last block, head dims
    that take each width of the kernel's value accumulators (AVX2: 64, 32, 8; AVX-512: 64, 16, 8), query heads per
    KV head 1, 3 and 7 (AVX-512's value pass takes them four at a time), sequences longer than the prefetch
    distance and than the value pass's runs of positions, work items of one KV head (2 KV heads, 3 tokens: 6 items)
    and of several (5: items of 3 and 2 heads): reads the cache in place, float32 or float16 (--kv-cache-dtype
    float16: against SDPA over the same float16 values widened)."""
    g = torch.Generator().manual_seed(0)
    bs, nb = 4, 12
    nblocks = 3 * nb
    h = hkv * group
    kv = torch.randn(2, nblocks * bs, hkv, d, generator=g).to(dtype)
    lens = torch.tensor(lens, dtype=torch.int64)
    table = torch.randperm(nblocks, generator=g).view(3, nb).contiguous()
    q = torch.randn(3, h, d, generator=g)
    out = torch.empty_like(q)
    lib.ts_attn_decode(q.data_ptr(), h * d, kv.data_ptr(), nblocks * bs, table.data_ptr(), nb, lens.data_ptr(), bs,
                       3, h, hkv, d, ctypes.c_float(d**-0.5), out.data_ptr(), h * d, int(dtype == torch.float16))
    kv = kv.float()
    for t in range(3):
        slots = torch.cat([torch.arange(b * bs, b * bs + bs) for b in table[t].tolist()])[: lens[t]]
        k = kv[0][slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = kv[1][slots].repeat_interleave(group, dim=1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[t][:, None], k, v)[:, 0]
        torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-4)


def _sdpa_over_table(kv: torch.Tensor, q: torch.Tensor, table: torch.Tensor, lens: list[int], bs: int, group: int):
    """SDPA over each token's positions of the paged cache kv [2, slots, Hkv, D] (widened to float32)."""
    kv = kv.float()
    refs = []
    for t, n in enumerate(lens):
        slots = torch.cat([torch.arange(b * bs, b * bs + bs) for b in table[t].tolist()])[:n]
        k = kv[0][slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = kv[1][slots].repeat_interleave(group, dim=1).transpose(0, 1)
        refs.append(F.scaled_dot_product_attention(q[t][:, None], k, v)[:, 0])
    return torch.stack(refs)


def _attn(lib, q, kv, table, lens, bs, hkv):
    t, h, d = q.shape
    out, seq_lens = torch.empty_like(q), torch.tensor(lens, dtype=torch.int64)
    lib.ts_attn_decode(q.data_ptr(), h * d, kv.data_ptr(), kv.shape[1], table.data_ptr(), table.shape[1],
                       seq_lens.data_ptr(), bs, t, h, hkv, d, ctypes.c_float(d**-0.5),
                       out.data_ptr(), h * d, int(kv.dtype == torch.float16))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h, hkv, d, lens", [(9, 3, 64, [1100]), (9, 3, 64, [257, 700, 9, 256]),
                                             (4, 4, 128, [513, 40]), (14, 2, 24, [2049, 300, 1]),
                                             (5, 5, 16, [258, 2000]), (9, 3, 64, [700, *[30] * 39])])
def test_long_sequences_split_in_chunks_match_sdpa(lib, h: int, hkv: int, d: int, lens: list[int], dtype):
    """In a step of few tokens, sequences longer than ATTN_CH (256) positions are split into chunks whose partial
    results are combined: one long sequence alone (the one-client case the split is for), a mix of split and whole
    ones (257: two chunks of unequal length, 256: one), 2049 (nine chunks), and a step of 40 tokens (not split),
    against SDPA; and in the steps of up to four tokens each token's result is bit-identical to its result alone
    (the chunks depend on its length only; the batch-invariant build never splits)."""
    g = torch.Generator().manual_seed(1)
    bs = 16
    nb = max(lens) // bs + 1
    nblocks = len(lens) * nb
    kv = torch.randn(2, nblocks * bs, hkv, d, generator=g).to(dtype)
    table = torch.randperm(nblocks, generator=g).view(len(lens), nb).contiguous()
    q = torch.randn(len(lens), h, d, generator=g)
    out = _attn(lib, q, kv, table, lens, bs, hkv)
    torch.testing.assert_close(out, _sdpa_over_table(kv, q, table, lens, bs, h // hkv), atol=1e-5, rtol=1e-4)
    for t, n in enumerate(lens if len(lens) <= 4 else []):
        alone = _attn(lib, q[t : t + 1].contiguous(), kv, table[t : t + 1].contiguous(), [n], bs, hkv)
        assert torch.equal(alone[0], out[t]), f"token {t} ({n} positions) alone differs from its result in the batch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h, hkv, d, prompts", [(9, 3, 64, [(0, 40)]), (9, 3, 64, [(150, 37), (0, 1), (5, 20)]),
                                                (9, 3, 64, [(50, 30)]),
                                                (4, 4, 128, [(70, 33), (0, 9)]), (14, 2, 24, [(300, 13), (0, 12)]),
                                                (32, 8, 128, [(3, 25)]), (5, 1, 16, [(65, 64), (1, 3)])])
def test_prompt_chunks_in_runs_match_sdpa(lib, h: int, hkv: int, d: int, prompts: list[tuple[int, int]], dtype):
    """A step of prompt chunks (each (cached positions, new tokens): token j of a chunk attends to its first
    cached + j + 1 positions, all over one block table) in the default build goes through runs of a sequence's
    tokens that share each K / V row (attn_run: chunks of 64 positions, an online softmax, the causal edge inside a
    chunk and, (50, 30)'s run over positions 59-66, across two): query heads per KV head 1, 3, 4, 5 and 7 (runs of
    48 / G tokens at most, fewer where the runs' items would not give each thread four), head dims 16 to 128, runs
    cut by their length and at a change of sequence, tokens attending to fewer than 32 positions (no run) and a lone
    token between runs, against SDPA."""
    g = torch.Generator().manual_seed(2)
    bs = 16
    nb = max(c + n for c, n in prompts) // bs + 1
    nblocks = len(prompts) * nb
    kv = torch.randn(2, nblocks * bs, hkv, d, generator=g).to(dtype)
    seq_tables = torch.randperm(nblocks, generator=g).view(len(prompts), nb)
    rows = [i for i, (c, n) in enumerate(prompts) for _ in range(n)]
    lens = [c + j + 1 for c, n in prompts for j in range(n)]
    table = seq_tables[rows].contiguous()
    q = torch.randn(len(lens), h, d, generator=g)
    out = _attn(lib, q, kv, table, lens, bs, hkv)
    torch.testing.assert_close(out, _sdpa_over_table(kv, q, table, lens, bs, h // hkv), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fn", [quantize_int4, quantize_int8])
def test_quantize_rows_in_chunks_equals_the_whole_matrix(fn):
    """The streaming loader quantizes a fused weight from its checkpoint parts, a chunk of rows at a time: the same
    codes, scales and mins as the whole matrix at once (parts and chunks that end mid-block included)."""
    from tokenspout.models.quantize import dequantize, quantize_rows

    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 96, generator=g)
    whole, deq = fn(w)
    for parts, chunk in (([w], 1024), ([w[:37], w[37:50], w[50:]], 8), ([w[:4], w[4:]], 4)):
        got = quantize_rows(parts, fn, chunk=chunk)
        assert (got.n, got.k, got.wt) == (whole.n, whole.k, whole.wt)
        for f in ("codes", "scale", "min"):
            a, b = getattr(got, f), getattr(whole, f)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f
    assert torch.equal(dequantize(whole), deq)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_c_quantizer_equals_the_torch_quantizer(lib, fmt):
    """kernels/csrc/quant_cpu.c (what a first start quantizes with where the kernels run) against models/quantize.py's
    torch quantizers: the same packed codes, scales and minimums bit for bit, over groups of every kind: random at
    different magnitudes, all zero, constant, tiny (a scale that rounds to zero in float16), one huge outlier,
    values just below and above rounding ties, and through quantize_rows' chunks."""
    from tokenspout.models.quantize import QUANTIZERS, quantize_rows, quantizer

    g = torch.Generator().manual_seed(11)
    w = torch.randn(70, 608, generator=g) * torch.logspace(-3, 2, 70)[:, None]
    w[0, :32] = 0.0
    w[1, 32:64] = 3.0
    w[2, :32] = 1e-9
    w[3, 5] = 1e6
    w[4, :32] = torch.arange(32) * 0.5 - 8.0  # exact halves: ties in q = w / scale
    w[5, 64:96] = -torch.arange(32) / 15.0
    fast, ref = quantizer(fmt, lib), QUANTIZERS[fmt]
    wb = w.bfloat16()  # a bf16 checkpoint's rows: the C quantizers read them without a float32 copy
    cases = [(fast(w)[0], ref(w)[0]), (quantize_rows([w[:37], w[37:]], fast, chunk=8), ref(w)[0]),
             (fast(wb)[0], ref(wb.float())[0]), (quantize_rows([wb[:37], wb[37:]], fast, chunk=8), ref(wb.float())[0])]
    for got, want in cases:
        assert (got.n, got.k, got.wt) == (want.n, want.k, want.wt)
        for f in ("codes", "scale", "min"):
            a, b = getattr(got, f), getattr(want, f)
            assert (a is None) == (b is None), f
            assert a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f


def quantized_reference(x: torch.Tensor, packed, deq: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
    """The kernels' result for activations rounded to xq: integer dots of the codes scaled, plus Q4's min term
    over the exact float group sums of x."""
    if packed.min is None:
        return xq @ deq.T
    m, k = x.shape
    mins = unpack_min(packed)
    return xq @ (deq - mins.repeat_interleave(32, 1)).T + x.view(m, k // 32, 32).sum(-1) @ mins.T


@pytest.mark.parametrize("fn", [quantize_int8, quantize_int4, quantize_int5])
@pytest.mark.parametrize("m", [1, 3, 7, 8, 9, 12, 13, 15, 16, 17, 40, 70])
@pytest.mark.parametrize("n, k", [(5, 96), (130, 608), (64, 128)])
def test_linear_int8_activations_match_their_reference(lib, fn, m, n, k):
    """act8 (--activation-quant int8): activations rounded to 255 levels per group on every path, the row path (int4
    below 14 rows with AVX2: the byte kernel block_q_a8, a lone last group (k = 96, 608) by the int16 kernels; with
    AVX-512 int4 below 12 rows and int8 below 9 by the int16 kernels over the int8 values, as int5 below 8 and int8
    below 16 rows with AVX2), the int8 tiled path for int4 codes (vpmaddubsw / vpdpbusd; padding rows at 9-15, 17
    and 70) and for int8 codes the int16 tile (AVX2) or vpdpbusd's (AVX-512): each equals the rounded activations'
    product within float32 rounding."""
    g = torch.Generator().manual_seed(m * 7919 + n + k)
    x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g)
    x[0, 32:64] = 0.0  # an all-zero activation group
    x[-1, :32] *= 1000.0  # a group of large values: its codes still reach +-127, the pair sums stay in int16
    packed, deq = fn(w)
    packed.act8 = True
    ref = quantized_reference(x, packed, deq, int16_activations(x, 127.0))
    got = cpu.linear(lib, x, packed)
    torch.testing.assert_close(got, ref, atol=1e-3 * float(ref.abs().max()) * 1e-2 + 5e-4, rtol=1e-4)
    # the int16 activations are another computation: int8 ones move the result by about 1/255 of a group's range
    packed.act8 = False
    exact = cpu.linear(lib, x, packed)
    assert (got - exact).abs().max() > 1e-4 * exact.abs().max()


def test_int8_activations_with_a_fused_tail(lib):
    """A fused weight of int4 rows and an int8 tail (a GGUF file's q / k with a Q6_K v) shares one rounding of the
    activations: both halves see the int8 values, on the row and on the tiled path."""
    g = torch.Generator().manual_seed(5)
    n_head, n_tail, k = 24, 12, 256
    w = torch.randn(n_head + n_tail, k, generator=g)
    head, deq_h = quantize_int4(w[:n_head])
    tail, deq_t = quantize_int8(w[n_head:])
    fused = dataclasses.replace(head, n=n_head + n_tail, tail=tail, act8=True)
    tail.act8 = True
    for m in (3, 33):
        x = torch.randn(m, k, generator=g)
        xq = int16_activations(x, 127.0)
        ref = torch.cat([quantized_reference(x, head, deq_h, xq), quantized_reference(x, tail, deq_t, xq)], 1)
        torch.testing.assert_close(cpu.linear(lib, x, fused), ref, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("n, k", [(5, 96), (130, 608), (8, 1088), (3, 32), (4, 64)])
def test_int5_packing_in_c_equals_torch_and_round_trips(lib, n, k):
    """pack_int5 by the C writer (ts_pack_q4 with int5) gives the torch packing's bytes, and dequantize() reads back the
    values: codes 0..31 in every position of a triple of groups, short last triples (one or two groups) zero-filled."""
    g = torch.Generator().manual_seed(n * 31 + k)
    q = torch.randint(0, 32, (n, k // 32, 32), generator=g).to(torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g) + 0.1).half()
    lo = torch.randn(n, k // 32, generator=g).half()
    want = pack_int5(q, scale, lo)
    got = pack_int5(q, scale, lo, lib)
    assert got.wt == want.wt == cpu.WT_Q5
    for f in ("codes", "scale", "min"):
        assert torch.equal(getattr(got, f).view(torch.uint8), getattr(want, f).view(torch.uint8)), f
    deq = (q.float() * scale.float()[..., None] + lo.float()[..., None]).view(n, k)
    torch.testing.assert_close(dequantize(got), deq, atol=0, rtol=0)


def test_int5_head_with_an_int8_tail(lib):
    """A fused weight of int5 rows and an int8 tail (a Q4_K_M file's Q5_0 q / k with a Q8_0 v), row and tiled paths,
    int16 and int8 activations."""
    g = torch.Generator().manual_seed(9)
    n_head, n_tail, k = 20, 12, 320
    w = torch.randn(n_head + n_tail, k, generator=g)
    head, deq_h = quantize_int5(w[:n_head], lib)
    tail, deq_t = quantize_int8(w[n_head:])
    for act8, levels in ((False, 32767.0), (True, 127.0)):
        fused = dataclasses.replace(head, n=n_head + n_tail, tail=dataclasses.replace(tail, act8=act8), act8=act8)
        for m in (1, 3, 33):
            x = torch.randn(m, k, generator=g)
            xq = int16_activations(x, levels)
            ref = torch.cat([quantized_reference(x, head, deq_h, xq), quantized_reference(x, tail, deq_t, xq)], 1)
            torch.testing.assert_close(cpu.linear(lib, x, fused), ref, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 16, 33])
def test_int8_codes_at_their_extremes_with_int8_activations(lib, m):
    """int8 codes -128 and 127 (a GGUF file's Q8_0 holds -128) times activations +-127 across whole groups, the
    largest dots: AVX-512's byte tile stores each code + 128 and takes 128 x the activations' sum back off, which must
    give the rounded activations' product exactly (m = 1: the int16 row kernel over the same values)."""
    k, n = 256, 8
    q = torch.full((n, k // 32, 32), 127, dtype=torch.int8)
    q[1::2] = -128
    q[2, :, ::3] = -128  # mixed signs in one group
    scale = torch.full((n, k // 32), 0.01).half()
    packed = pack_int8(q, scale)
    deq = (q.float() * scale.float()[..., None]).view(n, k)
    x = torch.full((m, k), 3.0)
    x[:, 1::2] = -3.0  # codes 127 and -127: every product at its largest, of either sign
    x[-1, :64] = 3.0  # all positive in two groups: the largest sums
    ref = quantized_reference(x, packed, deq, int16_activations(x, 127.0))
    got = cpu.linear(lib, x, dataclasses.replace(packed, act8=True))
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("m", [1, 8, 16, 33])
def test_int5_codes_at_their_maximum_with_int8_activations(lib, m):
    """The worst case of the int8 byte tile for int5 (from 8 rows with AVX2): codes 31 times activations 127 across
    a whole group give pair sums of 7874, which eight quads would overflow in int16; the sums must equal the
    rounded activations' product (m = 1: the int16 row kernel over the same values)."""
    k = 256
    w = torch.ones(12, k)
    w[:, ::32] = 0.0  # one code 0 per group, so the group's scale is nonzero and every other code is 31
    w[1] *= -1.0  # (a row of codes 0 except one 31: its min carries the values)
    x = torch.ones(m, k) * 3.0
    x[:, 1::2] = 2.9  # codes 127 and 123: all positive, the largest sums
    packed, deq = quantize_int5(w)
    ref = quantized_reference(x, packed, deq, int16_activations(x, 127.0))
    got = cpu.linear(lib, x, dataclasses.replace(packed, act8=True))
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 2, 7, 9, 10, 11, 13, 14, 15, 16, 17, 33, 70])
@pytest.mark.parametrize("n, k", [(5, 256), (130, 768), (8, 2304)])
def test_int6_from_q6k_computes_its_values(lib, m, n, k):
    """A GGUF file's Q6_K as the kernels' int6 (codes, sub-scales and d as the file holds them): dequantize() gives
    the gguf package's values bit for bit, and every path (the one-row kernel, the row path, the tiled path from 8
    rows with AVX2 / 10 with AVX-512, 11 there with act8; k = 2304 spans several of the tile's chunks of groups)
    computes the integer dots of those values with the activations rounded to +-16383 per group (int16 ones would
    overflow int32: see the next test), or to int8 ones with act8, within float32 rounding; with bias and
    accumulation."""
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    w[0, :64] = 0.0  # an all-zero pair of groups (sub-scales 0)
    x[0, 32:64] = 0.0
    packed, deq, raw = q6k_int6(w, lib)
    values = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q6_K).reshape(n, k).copy())
    assert torch.equal(deq, values) and torch.equal(dequantize(packed), values)
    assert (deq - w).abs().max() <= w.abs().max() / 31  # (a step at most: a sanity check of the helper's fit)
    b, y = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    for act8, levels in ((False, 16383.0), (True, 127.0)):
        packed.act8 = act8
        xq = int16_activations(x, levels).double()
        ref, tol = xq @ deq.double().T, 2e-6 * (xq.abs() @ deq.double().abs().T) + 1e-5

        def check(got, want):
            assert ((got.double() - want).abs() <= tol).all(), (act8, ((got.double() - want).abs() / tol).max())

        check(cpu.linear(lib, x, packed), ref)
        check(cpu.linear(lib, x, packed, bias=b), ref + b.double())
        check(cpu.linear(lib, x, packed, out=y.clone(), accumulate=True), y.double() + ref)


@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_int6_extremes_do_not_overflow(lib, m):
    """The largest int6 magnitudes (sub-scale -128 times code 0: 4096 units of d; 127 x 31) against a group of equal
    activations: 32 products of 4096 x 32767 would pass 2^31 in a group's int32 dot (the one-row kernel and the
    tiled path gave -224 for 7.3e6), so the activations of a linear with int6 weights are rounded to +-16383."""
    n, k = 6, 512
    q, sub = torch.zeros(n, k), torch.full((n, k // 16), -128.0)
    q[1], sub[1] = 63.0, 127.0
    q[2, ::2] = 63.0  # codes of both signs
    packed = empty_packed(n, k, cpu.WT_Q6)
    cpu.q6k_into(lib, q6k_raw(q, sub, torch.full((n, k // 256), 0.5)), None, k, 0, packed.codes, packed.scale)
    deq = dequantize(packed)
    assert deq[0, 0] == 0.5 * 4096 and deq[1, 0] == 0.5 * 127 * 31
    x = torch.full((m, k), 7.0)
    x[1:, 1::2] = -7.0
    for act8, levels in ((False, 16383.0), (True, 127.0)):
        packed.act8 = act8
        ref = int16_activations(x, levels).double() @ deq.double().T
        torch.testing.assert_close(cpu.linear(lib, x, packed).double(), ref, rtol=1e-6, atol=1e-3)


def test_int4_head_with_an_int6_tail(lib):
    """A fused weight of int4 rows and an int6 tail (a Q4_K_M file's Q4_K q / k with a Q6_K v): one rounding of the
    activations for both (+-16383, the tail's; int8 with act8), row and tiled paths."""
    g = torch.Generator().manual_seed(6)
    n_head, n_tail, k = 24, 12, 512
    w = torch.randn(n_head + n_tail, k, generator=g)
    head, deq_h = quantize_int4(w[:n_head])
    tail, deq_t, _ = q6k_int6(w[n_head:], lib)
    for act8, levels in ((False, 16383.0), (True, 127.0)):
        fused = dataclasses.replace(head, n=n_head + n_tail, tail=dataclasses.replace(tail, act8=act8), act8=act8)
        for m in (1, 3, 33):
            x = torch.randn(m, k, generator=g)
            xq = int16_activations(x, levels)
            ref = torch.cat([quantized_reference(x, head, deq_h, xq), xq @ deq_t.T], 1)
            torch.testing.assert_close(cpu.linear(lib, x, fused), ref, atol=5e-4, rtol=1e-4)


def test_batch_invariant_kernels_give_a_row_its_result_alone_at_every_batch_size():
    """The batch-invariant build: a row's outputs are bit-identical whether it is alone (the one-row kernels), among
    2-15 rows (the row path) or 16+ (the tiled path, padding rows included), for every weight format, with bias and
    accumulation, K ending on a lone group (96, 608) or a pair (1088), and N ending on a partial block of four."""
    lib = cpu.load(invariant=True)
    g = torch.Generator().manual_seed(5)
    formats = {"int8": lambda w: quantize_int8(w)[0], "int4": lambda w: quantize_int4(w)[0],
               "int5": lambda w: quantize_int5(w, lib)[0], "int6": lambda w: q6k_int6(w, lib)[0],
               "float32": lambda w: w, "bfloat16": lambda w: w.bfloat16()}
    for name, fn in formats.items():
        for k in (256, 768) if name == "int6" else (96, 608, 1088):  # (int6: Q6_K's super-blocks of 256)
            w = fn(torch.randn(38, k, generator=g))
            x, b, y = torch.randn(40, k, generator=g) * 3, torch.randn(38, generator=g), torch.randn(40, 38, generator=g)
            alone = torch.cat([cpu.linear(lib, x[i:i + 1], w, bias=b, out=y[i:i + 1].clone(), accumulate=True)
                               for i in range(40)])
            for m in (2, 3, 5, 8, 15, 16, 17, 33, 40):
                got = cpu.linear(lib, x[:m], w, bias=b, out=y[:m].clone(), accumulate=True)
                assert torch.equal(got, alone[:m]), (name, k, m)


def test_batch_invariant_kernels_are_the_avx2_level():
    with pytest.raises(ValueError, match="AVX2 level"):
        cpu.load("avx512", invariant=True)


@pytest.mark.parametrize("prompt", [False, True])
def test_bench_attention_case_runs(prompt: bool):
    """bench.attention's case (decode tokens, or one sequence's prompt chunk with --prompt) times a library and
    reports its rates."""
    from bench.attention import case

    row = case({"now": cpu.load()}, "smollm2-135m", 3, 20, 1, prompt)
    assert row["prompt"] is prompt and row["bit_identical"]
    assert row["now"]["ms"] > 0 and row["now"]["gb_s"] > 0 and row["now"]["gflop_s"] > 0
