"""Beam search against transformers' generate(num_beams=4, do_sample=False, early_stopping=True)."""

from __future__ import annotations

import pytest
import torch

from tokenspout import LLM

PROMPTS = ["The capital of France is", "Once upon a time", "def square(x):", "The best way to learn is",
           # a chat prompt whose beams end on EOS within the limit (finished hypotheses, early stopping)
           "<|im_start|>user\nWhat is 2+2? Answer with a number only.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(multiprocess=False, max_model_len=1024, kv_cache_memory=0.25)
    yield engine
    engine.shutdown()


def test_beam_search_matches_transformers(llm, hf_model, tokenizer):
    outs = llm.beam_search(PROMPTS, width=4, max_tokens=12)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            g = hf_model.generate(ids, num_beams=4, do_sample=False, early_stopping=True, max_new_tokens=12,
                                  eos_token_id=2, pad_token_id=2, output_scores=True, return_dict_in_generate=True)
        ref = g.sequences[0, ids.shape[1]:].tolist()
        if 2 in ref:
            ref = ref[: ref.index(2) + 1]
        best = out.outputs[0]
        assert best.token_ids == ref, prompt
        assert abs(best.cumulative_logprob / len(best.token_ids) - float(g.sequences_scores[0])) < 1e-3
        assert len(out.outputs) == 4
        if prompt.startswith("<|im_start|>"):
            assert best.token_ids[-1] == 2 and best.finish_reason == "stop"
        scores = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
        assert scores == sorted(scores, reverse=True)
