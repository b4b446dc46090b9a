"""Offline throughput: tokenspout's LLM.generate vs transformers' batched generate, in one run.

64 requests x (prompt ~100 tokens, 128 new tokens, ignore_eos) and a single request; prints tok/s for each and
the ratio; writes bench/results/throughput.json.

    python -m bench.throughput [--requests 64] [--new-tokens 128] [--prompt-tokens 100] [--skip-hf]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import prompts, write_json


def run_tokenspout(llm, texts: list[str], new_tokens: int) -> float:
    from tokenspout import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(texts, params)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(texts) * new_tokens / dt


def run_hf(model, tok, texts: list[str], new_tokens: int) -> float:
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t
    assert out.shape[1] - enc.input_ids.shape[1] == new_tokens
    return len(texts) * new_tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    from transformers import AutoModelForCausalLM

    from tokenspout import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(64, args.requests), max_num_batched_tokens=2048)
    tok = llm.get_tokenizer()
    texts = prompts(args.requests, tok, args.prompt_tokens)
    results: dict = {"requests": args.requests, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens}
    run_tokenspout(llm, texts[:2], 8)  # warm-up
    results["tokenspout_batch"] = run_tokenspout(llm, texts, args.new_tokens)
    results["tokenspout_single"] = run_tokenspout(llm, texts[:1], args.new_tokens)
    llm.shutdown()
    if not args.skip_hf:
        hf = AutoModelForCausalLM.from_pretrained(str(llm.config.model.model), dtype=torch.float32).eval()
        run_hf(hf, tok, texts[:2], 8)  # warm-up
        results["hf_batch"] = run_hf(hf, tok, texts, args.new_tokens)
        results["hf_single"] = run_hf(hf, tok, texts[:1], args.new_tokens)
        results["ratio_batch"] = results["tokenspout_batch"] / results["hf_batch"]
        results["ratio_single"] = results["tokenspout_single"] / results["hf_single"]
    print(f"{'case':<22}{'tokenspout tok/s':>18}{'transformers tok/s':>20}{'ratio':>8}")
    for case in ("batch", "single"):
        n = args.requests if case == "batch" else 1
        hf_v = results.get(f"hf_{case}", float("nan"))
        print(f"{f'{n} request(s)':<22}{results[f'tokenspout_{case}']:>18.1f}{hf_v:>20.1f}"
              f"{results[f'tokenspout_{case}'] / hf_v:>8.2f}")
    print("wrote", write_json("throughput.json", results))


if __name__ == "__main__":
    main()
