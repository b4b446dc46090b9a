"""The command line, the engine config and the offline SamplingParams refuse what would break later (audit of the
CLI and the offline API, session 30): values past the engine's sizes fail before any model loads, a field of the
wrong type never reaches the engine process (it killed its input thread: every later request hung), bad sampling
defaults in a model's generation_config.json fail the start naming the file, a top_p below float32's range keeps
the top token."""

from __future__ import annotations

import math

import pytest
import torch

from tokenspout.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenspout.engine.processor import Processor, read_generation_config, sampling_defaults
from tokenspout.entrypoints.cli import build_parser
from tokenspout.sample.sampler import Sampler
from tokenspout.sampling_params import SamplingParams
from tokenspout.worker.sampling_state import build_metadata


@pytest.mark.parametrize("argv", [["serve", "--port", "70000"], ["serve", "--port", "-1"],
                                  ["serve", "--shutdown-timeout", "inf"], ["serve", "--shutdown-timeout", "nan"],
                                  ["serve", "--shutdown-timeout", "-5"]])
def test_flags_out_of_range_exit_2_before_anything_loads(argv, capsys):
    parser, _ = build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2 and "must be" in capsys.readouterr().err


@pytest.mark.parametrize(("make", "says"), [
    (lambda: CacheConfig(kv_cache_memory_gib=math.nan), "kv_cache_memory"),
    (lambda: CacheConfig(kv_cache_memory_gib=1e18), "kv_cache_memory"),
    (lambda: CacheConfig(block_size=1 << 60), "block_size"),
    (lambda: SchedulerConfig(max_num_seqs=10**18), "max_num_seqs"),
])
def test_engine_sizes_are_bounded(make, says):
    with pytest.raises(ValueError, match=says):
        make().validate()


@pytest.mark.parametrize(("kw", "says"), [({"data_parallel_size": 10**18}, "data_parallel_size"),
                                          ({"num_threads": 0}, "num_threads"), ({"num_threads": -3}, "num_threads"),
                                          # a bool is no count (Python's int would take True as 1)
                                          ({"num_threads": True}, "num_threads"),
                                          ({"data_parallel_size": True}, "data_parallel_size")])
def test_engine_config_bounds(kw, says):
    import dataclasses

    with pytest.raises(ValueError, match=says):
        dataclasses.replace(EngineConfig(), **kw).validate()


@pytest.mark.parametrize(("kw", "field"), [
    ({"logprobs": 2.5}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids"), ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"bad_words": "Paris"}, "bad_words"), ({"top_k": True}, "top_k"),
    ({"mirostat": 1.0}, "mirostat"), ({"ignore_eos": "no"}, "ignore_eos"), ({"temperature": "0.5"}, "temperature"),
    ({"n": 10**18}, "n"), ({"max_tokens": True}, "max_tokens"),
])
def test_offline_fields_of_the_wrong_type_are_named(kw, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kw).validate()


def test_a_model_folders_sampling_defaults_are_checked_at_start():
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.9, "top_k": 50}) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 50}
    for bad in ({"temperature": -1}, {"top_p": 2}, {"repetition_penalty": 1e9}, {"temperature": math.nan}):
        with pytest.raises(ValueError, match="generation_config.json"):
            sampling_defaults(bad)


def test_a_model_folders_bad_eos_ids_and_shapes_are_ignored(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    assert read_generation_config(tmp_path) == {}

    class Tok:
        eos_token_id = 2

    p = Processor(Tok(), 64, 100, generation_config={"eos_token_id": [2, 999999, -5, "x", 7]})
    assert p.eos_token_id == 2 and p.extra_eos_token_ids == [7]


def test_a_top_p_below_float32s_range_keeps_the_top_token():
    v = 49152  # (a large vocabulary takes the truncation path that kept nothing; 512 rows did not show it)
    x = torch.randn(4, v, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(temperature=5.0, top_p=1e-300, seed=s) for s in range(4)]
    got = Sampler()(x.clone(), build_metadata(params, v)).sampled_token_ids  # type: ignore[arg-type]
    assert got.tolist() == x.argmax(-1).tolist()  # (was token 0 on every row)


def test_offline_beam_search_and_a_shut_down_llm():
    from tokenspout import LLM

    llm = LLM(multiprocess=False, max_model_len=256, kv_cache_memory=0.05)
    try:
        for n in (-1, 0, 5, True):
            with pytest.raises(ValueError, match="n must be an integer in"):
                llm.beam_search("Hi", width=2, max_tokens=2, n=n)
        with pytest.raises(ValueError, match="beam width"):
            llm.beam_search("Hi", width=2.5, max_tokens=2)  # type: ignore[arg-type]
        assert llm.beam_search([], width=2, max_tokens=2) == []
        assert len(llm.beam_search("Hi", width=2, max_tokens=2, n=1)[0].outputs) == 1
    finally:
        llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("Hi", SamplingParams(max_tokens=2))


def test_context_longer_than_the_kv_cache(loaded_model):
    """A KV cache holding fewer positions than max_model_len: an explicit max_model_len is a start-up error naming the
    memory it needs; the model's own length is lowered to the cache's, so a prompt past it is refused up front (it
    had been accepted, then ended at once: finish_reason "length", no text)."""
    from tokenspout.config import ModelConfig
    from tokenspout.core.engine_core import EngineCore
    from tokenspout.engine.messages import EngineCoreRequest
    from tokenspout.engine.processor import Processor
    from tokenspout.engine.tokenizer import load_tokenizer

    def core(max_model_len, blocks):
        return EngineCore(EngineConfig(model=ModelConfig(model=str(loaded_model.path), max_model_len=max_model_len),
                                       cache=CacheConfig(block_size=16, num_gpu_blocks_override=blocks)),
                          loaded=loaded_model)

    with pytest.raises(ValueError, match=r"max_model_len \(--max-model-len\) 2048 does not fit in the KV cache: "
                                         r"4 blocks .* holds 64 positions; one sequence of 2048 needs 0\.\d\d GiB.* "
                                         r"at most 64"):
        core(2048, 4)
    assert core(64, 4).max_model_len == 64  # exactly what it holds: fine
    small = core(None, 4)
    assert small.max_model_len == 64 and small.scheduler.max_model_len == 64
    proc = Processor(load_tokenizer(loaded_model.path), small.max_model_len, loaded_model.arch.vocab_size)
    with pytest.raises(ValueError, match="max_model_len"):
        proc.process("r", "word " * 100, SamplingParams(max_tokens=4))
    small.add_request(EngineCoreRequest("ok", list(range(1, 41)), SamplingParams(temperature=0.0, max_tokens=100,
                                                                                 ignore_eos=True)))
    got: list[int] = []
    while small.has_unfinished_requests():
        for o in small.step().outputs:
            got += o.new_token_ids
            if o.finish_reason:
                assert o.finish_reason == "length"
    assert len(got) == 24  # up to the 64 positions the cache holds


@pytest.mark.parametrize("kw, field", [({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
                                       ({"logit_bias": {1: "x"}}, "logit_bias"),
                                       ({"structured_outputs": {"json": {}}}, "structured_outputs")])
def test_offline_fields_of_the_wrong_shape_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):  # (were a TypeError / AttributeError naming nothing)
        SamplingParams(**kw).validate()
    ok = SamplingParams(logit_bias={"5": 2})
    ok.validate()
    assert ok.logit_bias == {5: 2.0}


@pytest.mark.parametrize("tools, choice, field", [
    (None, "sometimes", "tool_choice"), ([{"type": "function"}], None, r"tools\[0\]"),
    ([{"function": {"name": "f"}}], None, r"tools\[0\]"), ("f", None, "tools"),
    ([{"type": "function", "function": {"name": "f"}}], {"function": "f"}, "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, r"tools\[0\]\.function\.parameters")])
def test_offline_chat_checks_tool_shapes(tools, choice, field):
    """LLM.chat's tools / tool_choice have no request model to check them: a tool_choice "sometimes" was ignored,
    a tool without its "function" a KeyError."""
    from tokenspout.engine.chat_tools import selected_tools

    with pytest.raises(ValueError, match=f"^{field}: expected"):
        selected_tools(tools, choice)
    fine = [{"type": "function", "function": {"name": "f"}}]
    assert selected_tools(fine, {"type": "function", "function": {"name": "f"}}) == fine
