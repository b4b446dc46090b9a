"""GGUF files served directly: block conversion against the gguf package's own dequantization, llama.cpp's Q/K
permutation undone, and the default model's GGUF loaded straight from the file against the default model's folder
(which transformers converted from the same file)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from tokenspout.config import ModelConfig
from tokenspout.entrypoints.cli import resolve_quantization
from tokenspout.kernels import cpu
from tokenspout.models.default_model import gguf_path
from tokenspout.models.gguf_file import default_quantization, sidecar_folder
from tokenspout.models.gguf_model import GGUFCheckpoint, GGUFEmbedding, _blocks_of
from tokenspout.models.loader import load_model
from tokenspout.models.quantize import dequantize, pack_int4, pack_int8


@pytest.fixture(params=cpu.available_isas())
def lib(request):
    if cpu.load() is None:
        pytest.skip("C kernels unavailable on this machine")
    return cpu.load(request.param)


def test_q4_k_converts_to_int4_within_float16_rounding():
    """Q4_K super-blocks (random bytes: every scale/min bit pattern and code) become int4 groups of 32 whose values
    equal the gguf package's dequantization up to the float16 rounding of each group's scale (d x sc) and min."""
    from tokenspout.models.quantize import pack_int4

    g = np.random.default_rng(1)
    rows, supers = 6, 3
    raw = g.integers(0, 256, size=(rows, supers, 144), dtype=np.uint8)
    raw[..., 0:4] = (g.standard_normal((rows, supers, 2)) * 0.01).astype(np.float16).view(np.uint8).reshape(rows, supers, 4)
    raw = raw.reshape(rows, -1)
    ref = quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(rows, supers * 256)
    q, d, m = _blocks_of("Q4_K", raw)
    got = dequantize(pack_int4(q, d, m)).numpy()
    groups = np.abs(ref).reshape(rows, -1, 32).max(-1, keepdims=True)
    assert (np.abs(got - ref).reshape(rows, -1, 32) <= 2.0**-9 * groups + 1e-7).all()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_blocks_convert_exactly(kind):
    """llama.cpp's blocks (made by the gguf package's reference quantizer) become the kernels' format with the
    same values: dequantizing our packing equals the gguf package's dequantization, bit for bit."""
    g = np.random.default_rng(0)
    x = (g.standard_normal((12, 96)) * 0.1).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    t = GGMLQuantizationType[kind]
    raw = quants.quantize(x, t)
    ref = torch.from_numpy(quants.dequantize(raw, t).reshape(x.shape).astype(np.float32))
    q, d, m = _blocks_of(kind, raw)
    packed = pack_int8(q, d) if kind in ("Q5_0", "Q8_0") else pack_int4(q.to(torch.uint8), d, m)
    assert torch.equal(dequantize(packed), ref)


def test_rows_on_demand_equal_the_whole_tensor():
    """GGUFCheckpoint.rows (what re-quantization reads a chunk at a time, no float copy of the tensor) slices the
    same float32 rows as the whole tensor dequantized, Q/K rows un-permuted alike; the embedding module looks up
    the same rows."""
    ck = GGUFCheckpoint(gguf_path())
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                 "layers.1.mlp.down_proj.weight", "embed_tokens.weight"):
        whole, lazy = ck.get(name), ck.rows(name)
        assert tuple(lazy.shape) == tuple(whole.shape)
        n = whole.shape[0]
        for a, b in ((0, 7), (5, 64), (n - 9, n), (0, n)):
            assert torch.equal(lazy[a:b], whole[a:b]), (name, a, b)
    emb = GGUFEmbedding(gguf_path(), torch.bfloat16)
    ids = torch.tensor([[0, 17, 17], [49151, 2, 3]])
    assert torch.equal(emb(ids), ck.get("embed_tokens.weight")[ids].bfloat16())


def _k_blocks(g, kind: str, rows: int, supers: int) -> np.ndarray:
    """Random K-quant super-blocks with small finite float16 scales ([rows, supers * block bytes] uint8)."""
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    raw = g.integers(0, 256, size=(rows, supers, size), dtype=np.uint8)
    at, n = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}[kind]  # where the float16 d (and dmin) sit
    raw[..., at : at + 2 * n] = (g.standard_normal((rows, supers, n)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_q6_k_rows_equal_the_gguf_package():
    """gguf_model.q6k_rows (the first start's Q6_K dequantization) against the gguf package's, bit for bit, on
    random super-blocks (every code, scale sign and nibble pattern)."""
    from tokenspout.models.gguf_model import q6k_rows

    raw = _k_blocks(np.random.default_rng(5), "Q6_K", 9, 3)
    ref = quants.dequantize(raw, GGMLQuantizationType.Q6_K).reshape(9, -1).astype(np.float32)
    assert np.array_equal(q6k_rows(raw).numpy(), ref)


def test_k_quant_conversions_in_c_equal_the_python_ones(lib):
    """The first start's C conversions (csrc/quant_cpu.c) against the Python code they replace, byte for byte:
    Q4_K -> int4 (_q4k_blocks + pack_int4), Q6_K / Q5_K -> dequantized (q6k_rows / the gguf package) then int8
    (quantize_int8), and the packed layout written from codes (pack_int4 / pack_int8 in torch), each part written
    at its row offset into one weight (row counts that are not multiples of four, odd group counts, a row order as
    for llama.cpp's permuted Q / K rows)."""
    from tokenspout.models.gguf_model import _q4k_blocks, q6k_rows
    from tokenspout.models.quantize import empty_packed, quantize_int8

    def same(a, b) -> bool:
        return (a.n, a.k, a.wt) == (b.n, b.k, b.wt) and all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))

    g = np.random.default_rng(3)
    for parts, supers in (((6, 3), 3), ((1,), 1), ((9, 4, 7), 2)):
        k4 = [_k_blocks(g, "Q4_K", r, supers) for r in parts]
        k6 = [_k_blocks(g, "Q6_K", r, supers) for r in parts]
        k6[0][0, 192:208] = 0  # a super-block of zero scales: all-zero groups
        k5 = [_k_blocks(g, "Q5_K", r, supers) for r in parts]
        k5[0][0, 4:16] = 0  # zero scales and mins
        orders = [g.permutation(r) for r in parts]
        n, k = sum(parts), supers * 256
        ref4 = pack_int4(*(torch.cat(x) for x in zip(*(_q4k_blocks(raw[o]) for raw, o in zip(k4, orders)))))
        ref6 = quantize_int8(torch.cat([q6k_rows(raw[o]) for raw, o in zip(k6, orders)]))[0]
        ref5 = quantize_int8(torch.cat([torch.from_numpy(quants.dequantize(raw[o], GGMLQuantizationType.Q5_K))
                                        for raw, o in zip(k5, orders)]).view(n, k))[0]
        got4, got6, got5 = (empty_packed(n, k, wt) for wt in (cpu.WT_Q4, cpu.WT_Q8, cpu.WT_Q8))
        r4 = r6 = r5 = 0
        for raw4, raw6, raw5, o in zip(k4, k6, k5, orders):
            r4 += cpu.q4k_into(lib, raw4, o, k, r4, got4.codes, got4.scale, got4.min)
            r6 += cpu.k_int8_into(lib, "Q6_K", raw6, o, k, r6, got6.codes, got6.scale)
            r5 += cpu.k_int8_into(lib, "Q5_K", raw5, o, k, r5, got5.codes, got5.scale)
        assert r4 == r6 == r5 == n and same(got4, ref4) and same(got6, ref6) and same(got5, ref5)
    for n, groups in ((5, 3), (8, 4), (3, 1), (12, 7)):
        q = torch.from_numpy(g.integers(0, 16, size=(n, groups, 32), dtype=np.uint8))
        d = torch.from_numpy(g.standard_normal((n, groups)).astype(np.float16))
        m = torch.from_numpy(g.standard_normal((n, groups)).astype(np.float16))
        assert same(pack_int4(q, d, m, lib), pack_int4(q, d, m))
        q8 = q.view(torch.int8) - 8
        assert same(pack_int8(q8, d, lib), pack_int8(q8, d))
    with pytest.raises(ValueError, match="row order out of range"):
        cpu.q4k_into(lib, k4[0], np.array([0, 99]), k, 0, got4.codes, got4.scale, got4.min)
    with pytest.raises(ValueError, match="do not fit the packed weight"):  # (never a write past its end)
        cpu.k_int8_into(lib, "Q6_K", k6[0], None, k, n, got6.codes, got6.scale)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_legacy_blocks_convert_in_c_as_in_python(lib, kind):
    """Q8_0 / Q4_0 / Q4_1 blocks straight into the packed weight in C (cpu.blocks_into: what a first start of such a
    file runs) equal _blocks_of + pack_int8 / pack_int4 byte for byte: parts written at their row offsets, a row
    order, odd group counts (an int4 pair's empty upper half), every code and scale bit pattern (random bytes, NaN
    and infinite float16 terms included: copied, never computed, except Q4_0's min = -8 x its scale)."""
    from tokenspout.models.quantize import empty_packed

    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    wt = cpu.WT_Q8 if kind == "Q8_0" else cpu.WT_Q4
    g = np.random.default_rng(11)
    for parts, groups in (((6, 3), 3), ((1,), 1), ((9, 4, 7), 4)):
        raws = [g.integers(0, 256, size=(r, groups * size), dtype=np.uint8) for r in parts]
        orders = [g.permutation(r) for r in parts]
        n, k = sum(parts), groups * 32
        q, d, m = (torch.cat(x) for x in zip(*(_blocks_of(kind, raw[o]) for raw, o in zip(raws, orders))))
        ref = pack_int8(q, d) if kind == "Q8_0" else pack_int4(q.to(torch.uint8), d, m)
        got = empty_packed(n, k, wt)
        r0 = 0
        for raw, o in zip(raws, orders):
            r0 += cpu.blocks_into(lib, kind, raw, o, k, r0, got.codes, got.scale, got.min)
        assert r0 == n and all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in zip(got.tensors(), ref.tensors()))
    with pytest.raises(ValueError, match="do not fit the packed weight"):  # (never a write past its end)
        cpu.blocks_into(lib, kind, raws[0], None, k, n, got.codes, got.scale, got.min)
    with pytest.raises(ValueError, match="are not"):  # rows of another block size
        cpu.blocks_into(lib, kind, raws[0][:, :-1], None, k, 0, got.codes, got.scale, got.min)


def _attention_gguf(path: Path, raws: dict) -> Path:
    """A one-layer llama GGUF (two heads) holding blk.0.attn_{q,k,v}.weight as raws[name] = (rows of blocks, type)."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    for name, (raw, kind) in raws.items():
        w.add_tensor(f"blk.0.attn_{name}.weight", raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_int8_layer_of_exact_and_k_quant_parts(tmp_path: Path, lib):
    """Where the kernels run, a fused layer of exact int8 parts and Q5_K / Q6_K parts (a Q5_K_M file's Q8_0 / Q5_0 q,
    Q5_K k, Q6_K v) is int8 part by part, with int4 or int8 asked: the exact part keeps the file's values, the
    K-quant parts are their dequantized values quantized to int8 (they were all re-quantized from floats, the exact
    part too)."""
    from tokenspout.models.gguf_model import q6k_rows
    from tokenspout.models.quantize import quantize_int8

    g = np.random.default_rng(8)
    x = (g.standard_normal((8, 512)) * 0.05).astype(np.float32)
    raws = {"q": (quants.quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0),
            "k": (_k_blocks(g, "Q5_K", 8, 2), GGMLQuantizationType.Q5_K),
            "v": (_k_blocks(g, "Q6_K", 4, 2), GGMLQuantizationType.Q6_K)}
    ck = GGUFCheckpoint(_attention_gguf(tmp_path / "int8.gguf", raws))
    names = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    q_vals = ck.get(names[0])  # the file's values (un-permuted)
    k_vals = ck.get(names[1])
    v_vals = q6k_rows(raws["v"][0])
    for method in ("int4", "int8"):
        pw = ck.packed(names, method, lib)
        assert pw is not None and pw.wt == cpu.WT_Q8 and pw.tail is None and pw.n == 20
        got = dequantize(pw)
        assert torch.equal(got[:8], q_vals)
        assert torch.equal(got[8:16], dequantize(quantize_int8(k_vals)[0]))
        assert torch.equal(got[16:], dequantize(quantize_int8(v_vals)[0]))


@pytest.mark.parametrize("kernels", [False, True])
def test_fused_layer_of_two_formats(tmp_path: Path, kernels: bool):
    """Q4_K_M keeps v at Q6_K in half the layers: asked for int4, a fused q/k/v of Q4_K q / k and a Q6_K v keeps q / k
    as exact int4 and serves v as int6 with the kernels (its values exactly), as int8 without them (one weight of two
    formats, PackedWeight.tail), through the kernels and the quantized-weights cache alike; it went to int4 as a
    whole, re-fitted from the dequantized values, which moved the 1.7B shape's logits ~10x more.  Where the first format's rows are not whole blocks of four (v's 6 rows first)
    the whole layer is int8."""
    from tokenspout.kernels.cpu import WT_Q4, WT_Q6, WT_Q8

    g = np.random.default_rng(5)
    q4k, q6k = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
    raws = {"q": (_k_blocks(g, "Q4_K", 8, 2), q4k), "k": (_k_blocks(g, "Q4_K", 8, 2), q4k),
            "v": (_k_blocks(g, "Q6_K", 6, 2), q6k)}
    ck = GGUFCheckpoint(_attention_gguf(tmp_path / "mixed.gguf", raws))
    names = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    ref = torch.cat([ck.get(n) for n in names])
    lib = cpu.load() if kernels else None
    if kernels and lib is None:
        pytest.skip("C kernels unavailable on this machine")
    mixed = ck.packed(names, "int4", lib)  # (with the kernels: converted in C, tested equal above)
    tail_wt = WT_Q6 if kernels else WT_Q8
    assert mixed is not None and (mixed.wt, mixed.n, mixed.tail.wt, mixed.tail.n) == (WT_Q4, 22, tail_wt, 6)
    got = dequantize(mixed)
    groups = ref.abs().view(ref.shape[0], -1, 32).amax(-1, keepdim=True)
    err = (got - ref).abs().view(ref.shape[0], -1, 32)
    assert (err[:16] <= 2.0**-9 * groups[:16] + 1e-7).all()  # q / k: the file's codes (float16 group scales)
    if kernels:
        assert torch.equal(got[16:], ref[16:])  # v: int6, the file's values
    else:
        assert (err[16:] <= groups[16:] / 254 * 1.001 + 1e-9).all()  # v: int8, within half a step
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    for m in (1, 5):  # the row path, and (with the rows repeated) the tiled path
        xm = x[:m].repeat(4 if m == 5 else 1, 1)
        torch.testing.assert_close(cpu.linear(cpu.load(), xm, mixed), xm @ got.T, rtol=1e-3, atol=2e-3)
    whole = ck.packed([names[2], names[0], names[1]], "int4", lib)  # 6 rows of v first: one format, int8
    assert whole.wt == WT_Q8 and whole.tail is None


@pytest.fixture(scope="module")
def gguf_int4():
    return load_model(ModelConfig(model=str(gguf_path()), quantization="int4"))


@pytest.mark.skipif(cpu.load() is None, reason="kernels unavailable: the int4 model keeps float weights")
def test_default_gguf_served_from_the_file_equals_the_default_model(gguf_int4):
    """The default model's GGUF (Q4_1 layers, Q8_0 tied embedding), read straight from the file: every packed
    weight is bit-identical to the default model's int4 weights (quantized from the float32 folder transformers
    dequantized from the same file, Q/K rows un-permuted there by transformers and here by us), and so are the
    embedding (its rows read from the file as they are looked up) and the norms."""
    ref = load_model(ModelConfig(model=None, quantization="int4"))
    assert gguf_int4.arch == ref.arch and gguf_int4.name == "SmolLM2-135M-Instruct.Q4_1"
    assert gguf_int4.quantized.keys() == ref.quantized.keys()
    for name, pa in gguf_int4.quantized.items():
        pb = ref.quantized[name]
        for f in ("codes", "scale", "min"):
            a, b = getattr(pa, f), getattr(pb, f)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (name, f)
    sa, sb = gguf_int4.model.state_dict(), ref.model.state_dict()
    assert sa.keys() == sb.keys() - {"embed_tokens.weight"}  # the file's rows, not a float table
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    emb = gguf_int4.model.embed_tokens
    assert isinstance(emb, GGUFEmbedding) and emb.qtype.name == "Q8_0"
    ids = torch.arange(ref.arch.vocab_size)
    assert torch.equal(emb(ids), sb["embed_tokens.weight"])
    assert torch.equal(emb(ids[[5, 3, 5]].reshape(1, 3)), sb["embed_tokens.weight"][[5, 3, 5]].reshape(1, 3, -1))


def test_float_path_and_tokenizer_from_the_file(tokenizer):
    """--quantization none: the file's tensors dequantized (the gguf package) equal the default folder's; the sidecar
    folder's tokenizer and chat template come from the GGUF metadata and agree with the default model's."""
    from transformers import AutoTokenizer

    g = load_model(ModelConfig(model=str(gguf_path())))
    ref = load_model(ModelConfig(model=None))
    sa, sb = g.model.state_dict(), ref.model.state_dict()
    for k in sb:
        assert torch.equal(sa[k], sb[k]), k
    tok = AutoTokenizer.from_pretrained(sidecar_folder(gguf_path()))
    text = "Hello, how are you? Ça va très bien 🙂"
    assert tok(text).input_ids == tokenizer(text).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == tokenizer.apply_chat_template(msgs, tokenize=False)


def test_auto_quantization_follows_the_file():
    assert default_quantization(gguf_path()) == "int4"
    assert resolve_quantization("auto", str(gguf_path())) == "int4"
    assert resolve_quantization("auto", None) == "int4" and resolve_quantization("auto", "/some/folder") is None
    assert resolve_quantization("int8", str(gguf_path())) == "int8"


@pytest.mark.parametrize("kind, want", [(GGMLQuantizationType.Q4_K, "int4"), (GGMLQuantizationType.Q4_0, "int4"),
                                        (GGMLQuantizationType.IQ4_NL, "int8"), (GGMLQuantizationType.IQ4_XS, "int8"),
                                        (GGMLQuantizationType.Q6_K, "int8")])
def test_auto_quantization_of_four_bit_kinds(tmp_path: Path, kind, want):
    """IQ4_NL / IQ4_XS have 16 non-uniform levels: re-fitted to int4 they erred by 5% of a tensor's largest weight
    (logits off by 8 on a tiny model), so `auto` serves them as int8 (as the other types int4 cannot hold)."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    raw = np.zeros((64, 256 // block * size), dtype=np.uint8)
    path = _attention_gguf(tmp_path / "x.gguf", {n: (raw, kind) for n in ("q", "k", "v")})
    assert default_quantization(path) == want


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "tiny-gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported .*: tiny-gpt2.gguf"):
        sidecar_folder(path)
    with pytest.raises(FileNotFoundError):
        sidecar_folder(tmp_path / "missing.gguf")


def test_sidecars_of_gone_or_changed_files_are_pruned(tmp_path: Path, monkeypatch):
    """A GGUF file deleted, or replaced in place (its folder is then another one), leaves its sidecar folder behind:
    the next sidecar written removes it; `under` (the test suite's clean-up) removes those of files below a folder."""
    import json
    import os
    import shutil

    from tokenspout.models.gguf_file import SOURCE_FILE, _sidecar_name, prune_sidecars

    monkeypatch.setenv("TOKENSPOUT_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "gguf"

    def fake_sidecar(gguf: Path) -> Path:  # what prune reads of a folder: its name and source marker
        folder = root / _sidecar_name(gguf.resolve())
        folder.mkdir(parents=True)
        (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve()), "architecture": "llama"}))
        return folder

    files = {}
    for name in ("gone", "changed", "kept", "here"):
        files[name] = (tmp_path / "models" if name != "here" else tmp_path / "here") / f"{name}.gguf"
        files[name].parent.mkdir(exist_ok=True)
        if name != "kept":
            files[name].write_bytes(b"GGUF")
        else:  # a real file (its sidecar is written): linked where /tmp and the venv share a file system
            try:
                os.link(gguf_path(), files[name])
            except OSError:
                shutil.copyfile(gguf_path(), files[name])
    folders = {name: fake_sidecar(f) for name, f in files.items()}
    files["gone"].unlink()
    os.utime(files["changed"], ns=(0, files["changed"].stat().st_mtime_ns + 1))
    (root / "no-marker").mkdir()  # a damaged folder: left to sidecar_folder's rebuild
    real = sidecar_folder(files["kept"])  # a sidecar written: the pruning runs
    assert real == folders["kept"] and real.is_dir() and (real / "config.json").is_file()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == sorted(
        [folders["kept"].name, folders["here"].name, "no-marker"])
    assert prune_sidecars(under=tmp_path / "here") == [folders["here"]]
    assert prune_sidecars() == [] and real.is_dir()


def test_served_under_the_file_name():
    from tokenspout.engine.llm import build_engine_config

    cfg = build_engine_config(str(gguf_path()))
    assert cfg.model.served_model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert cfg.model.model == str(sidecar_folder(gguf_path()))
    assert build_engine_config(None).model.served_model_name == "SmolLM2-135M-Instruct"


def test_llm_serves_a_gguf_file_in_its_own_format():
    """LLM(model="x.gguf") / build_engine_config: a bare quantization=None keeps the file's format (as the server's
    auto), "none" asks for float weights (the CLI's --quantization none reaches it as "none"); folders keep None."""
    import argparse

    from tokenspout.engine.llm import build_engine_config
    from tokenspout.entrypoints.cli import add_engine_args, engine_kwargs

    assert build_engine_config(str(gguf_path())).model.quantization == "int4"
    assert build_engine_config(str(gguf_path()), quantization="none").model.quantization is None
    assert build_engine_config(str(gguf_path()), quantization="int8").model.quantization == "int8"
    assert build_engine_config(None).model.quantization is None
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for flag, want in (("none", None), ("auto", "int4"), ("int8", "int8")):
        args = p.parse_args(["--model", str(gguf_path()), "--quantization", flag])
        assert build_engine_config(args.model, **engine_kwargs(args)).model.quantization == want, flag


def test_tokenizer_flag(tmp_path: Path, model_path):
    """--tokenizer DIR: the folder's tokenizer replaces the model's (checked, a clear error when it holds none)."""
    from tokenspout.engine.llm import build_engine_config
    import argparse

    from tokenspout.entrypoints.cli import add_engine_args, engine_kwargs

    cfg = build_engine_config(str(gguf_path()), tokenizer=str(model_path))
    assert cfg.model.tokenizer_folder() == str(Path(model_path).resolve())
    assert build_engine_config(None).model.tokenizer_folder() == build_engine_config(None).model.folder()
    with pytest.raises(ValueError, match="tokenizer: .* is not a folder with tokenizer.json"):
        build_engine_config(None, tokenizer=str(tmp_path))
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", str(gguf_path()), "--tokenizer", str(model_path)])
    assert engine_kwargs(args)["tokenizer"] == str(model_path)


def test_corrupt_or_truncated_files_are_clear_errors(tmp_path: Path):
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(gguf_path().read_bytes()[:1_000_000])
    for bad in (not_gguf, truncated):
        with pytest.raises(ValueError, match=r"cannot read GGUF file .*\(not a GGUF file, or truncated or corrupt"):
            sidecar_folder(bad)
        with pytest.raises(ValueError, match="cannot read GGUF file"):
            resolve_quantization("auto", str(bad))


def test_header_reads_what_the_gguf_package_reads():
    """models/gguf_header.py against the gguf package's GGUFReader on the default model's file: every tensor's name,
    type, dims, offset, size and data view (typed and shaped alike, same bytes), every scalar metadata value."""
    from gguf import GGUFReader

    from tokenspout.models.gguf_file import field, open_reader

    mine, ref = open_reader(gguf_path()), GGUFReader(str(gguf_path()))
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors):
        assert (a.tensor_type, a.shape, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, tuple(b.shape.tolist()), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data[:3], b.data[:3]) and np.array_equal(a.data[-1:], b.data[-1:]), a.name
    scalars = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.") and f.types[0].name != "ARRAY"}
    assert len(scalars) > 20
    for k, f in scalars.items():
        v = f.parts[f.data[0]]
        want = bytes(v).decode() if f.types[0].name == "STRING" else v.tolist()[0]
        assert field(mine, k) == pytest.approx(want) if isinstance(want, float) else field(mine, k) == want, k


def test_transformers_reads_the_same_fields_through_the_fast_reader():
    """The sidecar's tokenizer and config come from transformers' GGUF conversion, fed by gguf_file's fast reader in
    place of the gguf package's: every metadata field (the vocabulary, merges and token types included) parses to
    the same value through transformers' own reading, and the tensors are the same."""
    from gguf import GGUFReader
    from transformers.integrations.ggml import _gguf_parse_value

    from tokenspout.models.gguf_file import _TransformersReader, open_reader

    fast, ref = _TransformersReader(open_reader(gguf_path(), raw=True)), GGUFReader(str(gguf_path()))
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # (the reader's own entries)
    assert fast.fields.keys() == ref_fields.keys()
    assert "tokenizer.ggml.tokens" in fast.fields and "tokenizer.ggml.merges" in fast.fields
    for k, f in ref_fields.items():
        g = fast.fields[k]
        assert [int(t) for t in g.types] == [int(t) for t in f.types], k
        got = [_gguf_parse_value(g.parts[i], g.types) for i in g.data]
        want = [_gguf_parse_value(f.parts[i], f.types) for i in f.data]
        assert got == want, k
    assert [t.name for t in fast.tensors] == [t.name for t in ref.tensors]


def _tiny_gguf(path: Path) -> bytes:
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["a", "bb", "ccc"])
    w.add_tensor("token_embd.weight", np.arange(8 * 32, dtype=np.float32).reshape(8, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_hostile_headers_are_clear_errors(tmp_path: Path):
    """Lengths and counts that run past the file, bad versions, unknown types: a ValueError naming the file, never
    a huge allocation or a crash."""
    from tokenspout.models.gguf_file import open_reader

    good = _tiny_gguf(tmp_path / "good.gguf")
    h = open_reader(tmp_path / "good.gguf")
    assert h.fields["llama.block_count"] == 1 and "tokenizer.ggml.tokens" not in h.fields  # (string arrays skipped)
    assert np.array_equal(h.tensors[0].data, np.arange(8 * 32, dtype=np.float32).reshape(8, 32))
    key = b"tokenizer.ggml.tokens"
    at = good.index(key) + len(key) + 4 + 4  # after the key, the value type (array) and the item type (string)
    tensor_at = good.index(b"token_embd.weight") + len(b"token_embd.weight")  # then dims count, 2 dims, type, offset
    cases = [  # (what the error says, the file)
        ("version 7", good[:4] + struct.pack("<I", 7) + good[8:]),
        ("declares an array of 1099511627776 items", good[:at] + struct.pack("<Q", 1 << 40) + good[at + 8:]),
        ("string array runs past", good[:at] + struct.pack("<Q", 1 << 20) + good[at + 8:]),
        ("string array runs past", good[:at + 8] + struct.pack("<Q", 1 << 40) + good[at + 16:]),
        ("empty file", b""),
        ("header runs past", good[:24]),
        ("has 9 dimensions", good[:tensor_at] + struct.pack("<I", 9) + good[tensor_at + 4:]),
        ("unknown type 999", good[:tensor_at + 4 + 16] + struct.pack("<I", 999) + good[tensor_at + 24:]),
        ("runs past the end of the file \\(", good[:tensor_at + 24] + struct.pack("<Q", 1 << 40) + good[tensor_at + 32:]),
    ]
    for i, (says, data) in enumerate(cases):
        bad = tmp_path / f"bad{i}.gguf"
        bad.write_bytes(data)
        with pytest.raises(ValueError, match=f"cannot read GGUF file .*{bad.name}: .*{says}"):
            open_reader(bad)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K"])
def test_5_bit_blocks_convert_to_int5(lib, kind):
    """Where the kernels run, Q5_0 / Q5_1 (the gguf package's reference quantizer) and Q5_K (random super-blocks: every
    code, scale and fifth-bit pattern) become int5 with the file's codes: the values equal the gguf package's
    dequantization bit for bit (Q5_0, Q5_1) or up to the float16 rounding of each group's scale and min (Q5_K, as
    Q4_K); rows written at an offset, in a permuted order, and the kernels compute with them."""
    from tokenspout.models.quantize import empty_packed

    g = np.random.default_rng(7)
    t = GGMLQuantizationType[kind]
    rows, k = 10, 512
    if kind == "Q5_K":
        raw = _k_blocks(g, "Q5_K", rows, k // 256)
    else:
        x = (g.standard_normal((rows, k)) * 0.1).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block
        raw = quants.quantize(x, t).reshape(rows, -1)
    ref = torch.from_numpy(quants.dequantize(raw, t).reshape(rows, k).astype(np.float32))
    order = g.permutation(rows)
    pw = empty_packed(rows + 3, k, cpu.WT_Q5)
    assert cpu.q5_into(lib, kind, raw, order, k, 3, pw.codes, pw.scale, pw.min) == rows
    got = dequantize(pw)[3:]
    want = ref[torch.from_numpy(order)]
    if kind == "Q5_K":
        groups = want.abs().view(rows, -1, 32).amax(-1, keepdim=True)
        assert ((got - want).abs().view(rows, -1, 32) <= 2.0**-9 * groups + 1e-7).all()
    else:
        assert torch.equal(got, want)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    out = cpu.linear(lib, x, pw)[:, 3:]
    torch.testing.assert_close(out, x @ got.T, rtol=1e-3, atol=2e-3)


def test_q5_0_layer_with_a_q8_0_v_is_int5_and_int8(tmp_path: Path, lib):
    """A Q4_K_M file of a 960-wide model keeps q / k at Q5_0 (llama-quantize's fallback for Q4_K) and v at Q8_0 in half
    the layers: asked for int4 or int8, the fused layer is int5 rows with an int8 tail, every value the file's."""
    g = np.random.default_rng(11)
    q50, q80 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0
    raws = {p: (quants.quantize((g.standard_normal((rows, 256)) * 0.05).astype(np.float32), kind), kind)
            for p, rows, kind in (("q", 8, q50), ("k", 8, q50), ("v", 4, q80))}
    ck = GGUFCheckpoint(_attention_gguf(tmp_path / "q5.gguf", raws))
    names = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    ref = torch.cat([ck.get(n) for n in names])
    for method in ("int4", "int8"):
        pw = ck.packed(names, method, lib)
        assert pw is not None and (pw.wt, pw.n, pw.tail.wt, pw.tail.n) == (cpu.WT_Q5, 20, cpu.WT_Q8, 4)
        assert torch.equal(dequantize(pw), ref)
    without = ck.packed(names, "int8", None)  # no kernels: Q5_0 is exact int8
    assert without is not None and without.wt == cpu.WT_Q8 and torch.equal(dequantize(without), ref)


def _rope_gguf(path: Path, kind, attn: float | None = None, yarn_attn: float | None = None) -> Path:
    """A header-only llama GGUF with RoPE scaling `kind` (factor 4, original context 64) and the attention factors."""
    from gguf import RopeScalingType

    w = GGUFWriter(str(path), "llama")
    w.add_rope_scaling_type(kind)
    w.add_rope_scaling_factor(4.0)
    if kind == RopeScalingType.YARN:
        w.add_rope_scaling_orig_ctx_len(64)
    if attn is not None:
        w.add_rope_scaling_attn_factors(attn)
    if yarn_attn is not None:
        w.add_rope_scaling_yarn_attn_factor(yarn_attn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_rope_attention_factors_of_a_file(tmp_path: Path):
    """YaRN's attention factor: the model's own (rope.scaling.yarn_attn_factor, which llama.cpp's converter copies
    from `attention_factor`) or YaRN's default 0.1 ln(factor) + 1, times rope.scaling.attn_factor (llama.cpp's
    multiplier of any scaling); that multiplier with another scaling, or a factor that is not a positive number,
    is a clear error naming the key."""
    import math

    from gguf import RopeScalingType

    from tokenspout.models.gguf_file import open_reader, rope_parameters

    def params(name: str, *args, **kw) -> dict:
        path = _rope_gguf(tmp_path / f"{name}.gguf", *args, **kw)
        return rope_parameters(path, open_reader(path), "llama", {"rope_theta": 1e4})

    yarn, linear = RopeScalingType.YARN, RopeScalingType.LINEAR
    assert "attention_factor" not in params("plain", yarn)  # transformers computes the default
    assert params("own", yarn, yarn_attn=0.8)["attention_factor"] == pytest.approx(0.8)
    assert params("both", yarn, attn=1.5, yarn_attn=0.8)["attention_factor"] == pytest.approx(1.2)
    assert params("mul", yarn, attn=1.5)["attention_factor"] == pytest.approx(1.5 * (0.1 * math.log(4.0) + 1))
    assert params("lin", linear, attn=1.0) == {"rope_theta": 1e4, "rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="attn_factor 1.5 is supported with YaRN scaling only, not with 'linear'"):
        params("lin15", linear, attn=1.5)
    for name, kw in (("neg", {"attn": -1.0}), ("nan", {"yarn_attn": float("nan")})):
        with pytest.raises(ValueError, match="attn_factor must be a positive number"):
            params(name, yarn, **kw)
