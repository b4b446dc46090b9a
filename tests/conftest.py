"""Session-wide fixtures: the default model is loaded once (ours and transformers') and shared by every test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Respect CPU affinity (taskset): more threads than usable cores makes every OpenMP op crawl.
torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)))))


@pytest.fixture(scope="session", autouse=True)
def _prune_test_caches(tmp_path_factory):
    """The session's temporary models (bf16 / fp16 folders, GGUF files) leave quantized-weights cache files and GGUF
    sidecar folders in $TOKENSPOUT_CACHE, ~1 GB per run: removed at the end (a later write would prune them too,
    but only once pytest has deleted their folders, three runs later)."""
    yield
    from tokenspout.models.gguf_file import prune_sidecars
    from tokenspout.models.quant_cache import prune

    base = tmp_path_factory.getbasetemp()
    prune_sidecars(under=base)
    prune(under=base)


@pytest.fixture(scope="session")
def model_path():
    from tokenspout.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="session")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def loaded_model(model_path):
    """Our float32 model, loaded once; EngineCores in tests share it (weights are read-only)."""
    from tokenspout.config import ModelConfig
    from tokenspout.models.loader import load_model

    return load_model(ModelConfig(model=str(model_path), max_model_len=2048))


TOOLS_TEMPLATE = Path(__file__).resolve().parent / "data" / "chatml_tools.jinja"


@pytest.fixture(scope="session")
def tools_server():
    """(engine, server): the default model behind a real server with the tool-capable ChatML template, shared by
    the tool-calling and agent-client e2e tests (one engine process for both)."""
    from tests.helpers import background_server, real_engine

    with real_engine(chat_template=str(TOOLS_TEMPLATE)) as engine, \
            background_server(engine, trust_request_chat_template=True) as srv:
        yield engine, srv
