"""The C decode kernels against the torch path, and the quantized models against float32 (quality checks)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import kernel_levels, kernel_lib, make_core, run_to_completion
from tests.parity.test_greedy_parity import PROMPTS
from tokenspout.config import ModelConfig
from tokenspout.engine.messages import EngineCoreRequest
from tokenspout.entrypoints.cli import resolve_quantization
from tokenspout.kernels import cpu
from tokenspout.models.loader import load_model
from tokenspout.models.quantize import QUANTIZERS, dequantize
from tokenspout.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="decode kernels unavailable on this machine")


def greedy_with_logits(loaded, prompts, n, use_kernels=True, kv_cache_dtype="auto"):
    core = make_core(loaded, kv_cache_dtype=kv_cache_dtype)
    if not use_kernels:
        core.runner.decoder = None
    logits: dict[str, list[torch.Tensor]] = {}
    core.runner.logits_hook = lambda ids, lg: [logits.setdefault(r, []).append(lg[i].clone()) for i, r in enumerate(ids)]
    out = run_to_completion(core, prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return out, logits


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(params=kernel_levels())
def isa(request, monkeypatch):
    """Each ISA level this CPU has, forced as TOKENSPOUT_ISA forces it (the engine's kernels are that level's), and
    each one it lacks built on SIMDe's intrinsics (cpu.load then returns that build)."""
    if request.param.endswith("-emulated"):
        lib = kernel_lib(request.param)
        monkeypatch.setattr(cpu, "load", lambda isa=None, invariant=False: lib)
    else:
        monkeypatch.setenv("TOKENSPOUT_ISA", request.param)
    return request.param


def test_kernel_path_matches_torch_path(loaded_model, prompt_ids, isa):
    """Batches of 1..8 decode tokens run through the kernels; the same requests through torch agree."""
    decoder = make_core(loaded_model).runner.decoder
    assert decoder is not None and decoder.lib is cpu.load(isa)
    for batch in (prompt_ids[:1], prompt_ids[:5]):
        ours, lk = greedy_with_logits(loaded_model, batch, 10)
        ref, lt = greedy_with_logits(loaded_model, batch, 10, use_kernels=False)
        assert ours == ref
        for r in ref:
            for a, b in zip(lk[r], lt[r]):
                assert float((a - b).abs().max()) < 1e-3


@pytest.fixture(scope="module")
def int4_model(model_path):
    return load_model(ModelConfig(model=str(model_path), max_model_len=512, quantization="int4"))


def test_int4_is_lossless_on_the_default_model(loaded_model, int4_model):
    """The default model's layers are Q4_1 and its tied embedding Q8_0 in the GGUF: int4 (Q4_1 layers, Q8_0 LM
    head) re-derives exactly those grids, so the dequantized weights equal the float32 ones to rounding."""
    ref = dict(loaded_model.model.named_parameters(remove_duplicate=False))
    checked = 0
    for name, pw in int4_model.quantized.items():  # the packed weights (the model holds no float copy of them)
        w = dequantize(pw)
        assert float((w - ref[name + ".weight"]).abs().max()) <= 1e-5 * float(ref[name + ".weight"].abs().max()), name
        checked += 1
    assert checked == 4 * loaded_model.arch.num_layers + 1


@pytest.mark.parametrize("copies,tokens", [(1, 16), (4, 6)])
def test_int4_greedy_and_logits_match_float32(loaded_model, int4_model, prompt_ids, copies, tokens, isa):
    """The kernels run int4 weights (the float32 model's own values on this model) with int16 activations per
    group of 32.  Measured: max |logit error| 0.014 over 8 prompts x 16 tokens (median 0.005), all tokens equal.
    A differing token is allowed only at a near-tie of the float32 logits (gap < 0.05), and is reported.
    8 rows take the kernels' row path; 32 (each prompt four times) the tiled path (from 16 rows with AVX2, 28
    with AVX-512), LM head included;
    at every ISA level (AVX2, AVX-512 VNNI)."""
    if isa.endswith("-emulated") and copies == 1:
        pytest.skip("emulated (slow): the tiled case only; the kernel tests check its row path")
    prompts = prompt_ids * copies
    decoder = make_core(int4_model).runner.decoder
    assert decoder.max_tokens >= len(prompts) and decoder.lib is cpu.load(isa)
    ours, lq = greedy_with_logits(int4_model, prompts, tokens)
    ref, lf = greedy_with_logits(loaded_model, prompts, tokens)
    same = [next((i for i, (a, b) in enumerate(zip(ours[r], ref[r])) if a != b), len(ref[r])) for r in ref]
    # logits compared while both runs have the same context (up to and including a first differing token)
    errs = [float((a - b).abs().max()) for r, k in zip(ref, same) for a, b in list(zip(lq[r], lf[r]))[: k + 1]]
    assert max(errs) < 0.05, max(errs)
    for r, k in zip(ref, same):
        if k < len(ref[r]):
            top = torch.topk(lf[r][k], 2).values
            print(f"{r}: token {k} differs at a float32 near-tie, top-2 gap {float(top[0] - top[1]):.4f}")
            assert float(top[0] - top[1]) < 0.05


@pytest.fixture(scope="module")
def int4_act8_model(model_path):
    return load_model(ModelConfig(model=str(model_path), max_model_len=512, quantization="int4",
                                  activation_quant="int8"))


def test_int8_activations_stay_near_float32(loaded_model, int4_model, int4_act8_model, prompt_ids):
    """--activation-quant int8: every quantized layer but the LM head rounds its inputs to 255 levels per group of
    32 (llama.cpp's numerics), on the row path (8 rows) and the tiled path (32 rows: the byte tile, vpmaddubsw with
    AVX2, vpdpbusd with AVX-512; the kernel tests check every level's, emulated ones included, against the integer
    reference).  Against float32
    (the same weights on this model) the logits move far more than int16's 0.014 (max over the vocabulary per
    position: measured max 4.4, median 1.4 over these prompts, the context kept equal up to a first differing
    token), yet stay bounded; a broken kernel gives logits off by tens."""
    assert all(pw.act8 == (name != "lm_head") for name, pw in int4_act8_model.quantized.items())
    assert not any(pw.act8 for pw in int4_model.quantized.values())
    errs, moved = [], []
    for copies in (1, 4):
        prompts = prompt_ids * copies
        ours, l8 = greedy_with_logits(int4_act8_model, prompts, 6)
        _, l16 = greedy_with_logits(int4_model, prompts, 6)
        ref, lf = greedy_with_logits(loaded_model, prompts, 6)
        for r in ref:
            k = next((i for i, (a, b) in enumerate(zip(ours[r], ref[r])) if a != b), len(ref[r]))
            errs += [float((a - b).abs().max()) for a, b in list(zip(l8[r], lf[r]))[: k + 1]]
            moved.append(float((l8[r][0] - l16[r][0]).abs().max()))  # first token: the same context for both
    errs.sort()
    print(f"int8 activations vs float32: max |logit error| {errs[-1]:.3f}, median {errs[len(errs) // 2]:.3f}")
    assert min(moved) > 1e-3  # the setting is in effect on both paths
    assert errs[-1] < 8.0 and errs[len(errs) // 2] < 2.5


def test_float16_kv_cache(loaded_model, int4_model, prompt_ids):
    """--kv-cache-dtype float16: the kernels and the torch path round K/V the same way (round to nearest even) and
    read them back the same, so on the float32 model the two paths agree (within 0.01: the paths' float32 K/V differ
    in summation order by ~1e-6, which now and then rounds to neighbouring float16 values; measured 0.005).  int4 with a
    float16 cache against float32 everywhere, 32 rows (the tiled path): the logits move by at most 0.1 (measured
    0.022; int4 alone 0.014), and a differing greedy token is allowed only at a float32 near-tie."""
    half = make_core(int4_model, kv_cache_dtype="float16").runner
    assert half.kv_caches[0].dtype == torch.float16
    assert half.num_blocks == 2 * make_core(int4_model).runner.num_blocks  # the same budget holds twice the tokens
    kern, lk = greedy_with_logits(loaded_model, prompt_ids[:5], 8, kv_cache_dtype="float16")
    torch_path, lt = greedy_with_logits(loaded_model, prompt_ids[:5], 8, use_kernels=False, kv_cache_dtype="float16")
    assert kern == torch_path
    for r in torch_path:
        for a, b in zip(lk[r], lt[r]):
            assert float((a - b).abs().max()) < 1e-2
    prompts = prompt_ids * 4
    ours, lh = greedy_with_logits(int4_model, prompts, 6, kv_cache_dtype="float16")
    ref, lf = greedy_with_logits(loaded_model, prompts, 6)
    errs = []
    for r in ref:
        k = next((i for i, (a, b) in enumerate(zip(ours[r], ref[r])) if a != b), len(ref[r]))
        errs += [float((a - b).abs().max()) for a, b in list(zip(lh[r], lf[r]))[: k + 1]]
        if k < len(ref[r]):
            top = torch.topk(lf[r][k], 2).values
            assert float(top[0] - top[1]) < 0.05
    print(f"int4 + float16 KV vs float32: max |logit error| {max(errs):.4f}")
    assert max(errs) < 0.1, max(errs)


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def half_models(model_path, tmp_path_factory):
    """The default model saved as a bfloat16 and a float16 checkpoint, each loaded twice: `--quantization auto`
    (what it resolves to: the folder's own 16-bit type, served through the kernels) and as the float32 torch model of
    the very same values (`--quantization none`), the oracle."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_path / "model.safetensors"))
    out = {}
    for fmt, dtype in HALF.items():
        folder = tmp_path_factory.mktemp(fmt)
        for f in model_path.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, folder / f.name)
        save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
        auto = resolve_quantization("auto", str(folder))
        out[fmt] = (auto, load_model(ModelConfig(model=str(folder), max_model_len=512, quantization=auto)),
                    load_model(ModelConfig(model=str(folder), max_model_len=512)))
    return out


@pytest.mark.parametrize("fmt", list(HALF))
def test_16bit_checkpoint_keeps_16bit_weights_and_matches_float32(half_models, prompt_ids, fmt, isa):
    """A bf16 / fp16 folder: auto keeps its weights 16-bit (no float32 copy of any linear layer) and the kernels,
    which widen them in registers, give the float32 torch model's greedy tokens and logits (within 1e-3: summation
    order) on 3 rows (the row path) and 32 (the float tiled path, LM head included), at every ISA level."""
    if isa.endswith("-emulated") and fmt != "bf16":
        pytest.skip("emulated (slow): bf16 only; the kernel tests check float16 weights")
    auto, half, ref_model = half_models[fmt]
    assert auto == fmt
    assert half.quantized and all(pw.codes.dtype == HALF[fmt] for pw in half.quantized.values())
    assert not any(p.dim() == 2 and p.dtype == torch.float32 and "embed" not in name
                   for name, p in half.model.named_parameters())
    for prompts in (prompt_ids[:3], prompt_ids * 4):
        ours, lh = greedy_with_logits(half, prompts, 5)
        ref, lf = greedy_with_logits(ref_model, prompts, 5, use_kernels=False)
        assert ours == ref
        err = max(float((a - b).abs().max()) for r in ref for a, b in zip(lh[r], lf[r]))
        assert err < 1e-3, err


def test_fp16_refuses_weights_beyond_its_range():
    """float16 tops out at 65504: a weight beyond it would become inf, so the conversion says so instead."""
    w = torch.randn(8, 64)
    w[3, 5] = 1e5
    with pytest.raises(ValueError, match="overflow fp16"):
        QUANTIZERS["fp16"](w)
    packed, values = QUANTIZERS["bf16"](w)
    assert packed.codes.dtype == torch.bfloat16 and torch.equal(values, w.to(torch.bfloat16).float())


def test_int8_quality_bound(model_path, loaded_model, prompt_ids):
    """int8 (Q8_0 everywhere) re-quantizes the default model's Q4_1 layers: lossy (use int4 on this model).
    Measured: last-position logits within ~1 of float32 over these prompts, the first greedy token the same on 7/8
    (the 8th is a near-tie)."""
    q8 = load_model(ModelConfig(model=str(model_path), max_model_len=512, quantization="int8"))
    _, lq = greedy_with_logits(q8, prompt_ids, 1)
    _, lf = greedy_with_logits(loaded_model, prompt_ids, 1)
    errs = [float((lq[r][0] - lf[r][0]).abs().max()) for r in lf]
    agree = sum(int(lq[r][0].argmax()) == int(lf[r][0].argmax()) for r in lf)
    print(f"int8 vs float32: max |logit error| {max(errs):.3f}, first greedy token agrees on {agree}/{len(lf)}")
    assert max(errs) < 1.5, errs
    assert agree >= len(lf) - 1


def _mixed_steps(core, prompt_ids: list[list[int]], long: list[int], params: SamplingParams, add_at: int):
    """Four requests, then a long prompt at step add_at, to the end: the tokens, every sampled row's logits and each
    step's (kernel tokens, tokens, torch metadata or not)."""
    splits, flat_batch = [], core.runner.flat_batch

    def spy(*args, **kw):
        flat = flat_batch(*args, **kw)
        splits.append((flat.kernel_tokens, int(flat.positions.numel()), flat.meta is not None))
        return flat

    core.runner.flat_batch = spy
    logits: dict[str, list[torch.Tensor]] = {}
    core.runner.logits_hook = lambda ids, lg: [logits.setdefault(r, []).append(lg[i].clone())
                                               for i, r in enumerate(ids)]
    for i, ids in enumerate(prompt_ids[:4]):
        core.add_request(EngineCoreRequest(str(i), ids, params))
    out: dict[str, list[int]] = {}
    for step in range(200):
        if step == add_at:
            core.add_request(EngineCoreRequest("long", long, params))
        if step > add_at and not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, logits, splits


def _long_prompt(tokenizer) -> list[int]:
    return tokenizer(" ".join(["The quick brown fox jumps over the lazy dog."] * 12)).input_ids


def test_mixed_step_runs_decodes_in_kernels_and_chunks_in_torch(loaded_model, prompt_ids, tokenizer):
    """A step above the kernels' token limit (decodes + a long prefill chunk) runs its decode rows through the
    C decoder and only the chunk through torch; tokens and logits agree with the torch path for everything."""
    long = _long_prompt(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(use_kernels: bool):
        core = make_core(loaded_model)
        assert len(long) > core.runner.decoder.max_tokens
        if not use_kernels:
            core.runner.decoder = None
        return _mixed_steps(core, prompt_ids, long, params, 3)

    ours, lk, splits = run(True)
    ref, lt, _ = run(False)
    assert (4, 4 + len(long), True) in splits  # four decode rows in the kernels beside the torch chunk
    assert ours == ref and len(ours) == 5
    for r in ref:
        for a, b in zip(lk[r], lt[r]):
            assert float((a - b).abs().max()) < 1e-3


def test_large_quantized_steps_run_in_the_kernels_in_slices(int4_model, prompt_ids, tokenizer, monkeypatch):
    """A quantized model's step of any size runs in the C decoder (no torch fallback), in slices of SLICE_TOKENS
    run in order: a step of four decodes and a 120-token prompt chunk, sliced every 16 tokens (the chunk's tokens
    across slices attend to the K / V earlier slices wrote), gives the tokens and logits of the same step run as
    one call (logits within 0.02: slices of 16 rows take other summation orders in the linears and the attention,
    whose rounding the int16 activations' ~0.01 already bounds)."""
    from tokenspout.kernels import decoder as dec

    long = _long_prompt(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(slice_tokens: int):
        monkeypatch.setattr(dec, "SLICE_TOKENS", slice_tokens)
        core = make_core(int4_model)
        assert core.runner.decoder.max_tokens >= 1 << 20  # a step of any budget goes to the kernels
        return _mixed_steps(core, prompt_ids, long, params, 2)

    sliced, ls, splits = run(16)
    whole, lw, _ = run(1 << 20)
    assert len(long) > 100 and (4 + len(long), 4 + len(long), False) in splits  # the whole mixed step in the kernels
    assert sliced == whole and len(sliced) == 5
    for r in whole:
        for a, b in zip(ls[r], lw[r]):
            assert float((a - b).abs().max()) < 0.02


def test_decode_only_batch_metadata_matches_the_general_path(int4_model, prompt_ids):
    """Pure decode steps build their flat batch in numpy (ModelRunner._decode_batch): the same positions, slots,
    sequence lengths and block ids as the torch path computes for the same rows."""
    core = make_core(int4_model, block_size=4)  # small blocks: the rows span several
    for i, ids in enumerate(prompt_ids[:5]):
        core.add_request(EngineCoreRequest(str(i), ids + [7] * (3 * i), SamplingParams(max_tokens=9, ignore_eos=True)))
    for _ in range(4):
        core.step()
    r = core.runner
    sched = core.scheduler.schedule()
    step = r.prepare(sched)
    starts = [e.start for e in step.entries]
    assert len(step.rows) == 5 and len(set(starts)) == 5 and step.flat.meta is None
    fast = step.flat
    ref = r.flat_batch(step.rows, starts, [1] * 5, None)  # no decoder: the general path, with torch metadata
    assert torch.equal(fast.positions, ref.positions) and torch.equal(fast.slot_mapping, ref.slot_mapping)
    assert torch.equal(fast.query_start_loc, ref.query_start_loc)
    assert torch.equal(fast.seq_lens, ref.meta.decode_seq_lens)
    assert torch.equal(fast.decode_block_ids.reshape(-1), ref.meta.decode_block_ids)
    assert fast.kernel_tokens == 5


@pytest.mark.parametrize("which", ["float32", "int4"])
def test_decode_steps_take_their_logits_from_the_layers_call(loaded_model, int4_model, prompt_ids, which, isa):
    """A step of decodes whose every row samples gets its logits from the same kernel call as its layers
    (CpuDecoder.forward_logits: the final norm and LM head in the layers' parallel region); the logits equal,
    bit for bit, those of the separate norm + LM head call, at 1 row and at 16 (the tiled path; natively built
    levels only: 16 rows on SIMDe's emulated intrinsics take ~40 s, and the fusion is the same code on every level),
    every step's written into the one buffer the decoder keeps."""
    loaded = loaded_model if which == "float32" else int4_model
    prompts = (prompt_ids * 4)[:16]

    def run(fused: bool, batch):
        core = make_core(loaded)
        calls = []
        if fused:
            inner = core.runner.decoder.forward_logits

            def traced(*a):
                hidden, lg = inner(*a)
                calls.append((a[0].shape[0], lg.data_ptr()))
                return hidden, lg
            core.runner.decoder.forward_logits = traced
        else:
            core.runner._fuses_logits = lambda step, n: False
        logits: dict[str, list[torch.Tensor]] = {}
        core.runner.logits_hook = lambda ids, lg: [logits.setdefault(r, []).append(lg[i].clone())
                                                   for i, r in enumerate(ids)]
        out = run_to_completion(core, batch, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        return out, logits, calls

    for batch in (prompts[:1], prompts) if not isa.endswith("-emulated") else (prompts[:1],):
        ours, lk, calls = run(True, batch)
        ref, lr, _ = run(False, batch)
        assert ours == ref
        assert len(batch) in [n for n, _ in calls]  # (the prefill steps sample through the torch path's logits)
        # every step writes its logits into the one buffer the decoder keeps (fresh pages each step cost ~5%)
        assert len({p for _, p in calls}) == 1, calls
        for r in ref:
            assert len(lk[r]) == len(lr[r]) == 6
            assert all(torch.equal(a, b) for a, b in zip(lk[r], lr[r])), r
