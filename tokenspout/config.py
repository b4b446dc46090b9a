"""Validated configuration dataclasses, built once from CLI flags or LLM(...) keyword arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenspout.checks import is_int

KV_CACHE_DTYPES = ("auto", "float16")
ACTIVATION_QUANTS = ("int16", "int8")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


# Upper bounds of the engine's sizes (values past them reached allocators after the model loaded; -dp 10^18 built
# engine configs for ever)
MAX_BLOCK_SIZE = 4096
MAX_KV_CACHE_GIB = 1 << 16
MAX_NUM_SEQS = 1 << 16
MAX_DATA_PARALLEL = 64
MAX_THREADS = 1024


@dataclass(slots=True)
class ModelConfig:
    model: str | None = None  # local folder; None = the default model (converted once from its GGUF)
    dtype: str = "float32"  # "float32" | "bfloat16" | "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    served_model_name: str | None = None
    seed: int = 0  # seeds random choices the engine makes (e.g. seeds for unseeded requests)
    # None | "int8" | "int4" (weight-only, groups of 32) | "bf16" | "fp16" (16-bit float weights): models/quantize.py
    quantization: str | None = None
    # "auto": generation_config.json's sampling values are the defaults of requests that omit them (vLLM's
    # --generation-config auto); "vllm": neutral defaults whatever the model folder says.
    generation_config: str = "auto"
    chat_template: str | None = None  # Jinja text replacing the tokenizer's (--chat-template); None: the model's
    tokenizer: str | None = None  # a folder whose tokenizer (and its chat template) replaces the model's (--tokenizer)
    # How the C kernels round the activations of int4 / int8 linear layers (not the LM head) before the integer dot
    # products: "int16" (65535 levels per group of 32: float32-level results, the default) or "int8" (255 levels,
    # llama.cpp's numerics: with AVX2, int4 layers multiply 1.4-1.7x faster from 8 rows (prefill, batches) and
    # ~1.1x at one row, at ~1 logit of error on the default model).  Without the kernels (or with float weights) it
    # changes nothing.
    activation_quant: str = "int16"
    # A request's result independent of the batch it shares (--batch-invariant; vLLM's batch-invariant mode): the
    # C kernels' batch-invariant build (one summation order for a row at every batch size, kernels/cpu.py) runs
    # every step, prompts included.  Needs the kernels (AVX2 + FMA + F16C, float32 compute, a model they take) and
    # int16 activations; costs ~10-20% of the linear layers' time at 2-15 rows a step (README).
    batch_invariant: bool = False

    def folder(self) -> str:
        """The local model folder.  The frontend needs it resolved (build_engine_config converts the default model
        and fills it in); the model loader alone resolves None itself."""
        if self.model is None:
            raise ValueError("model: no folder resolved; build the config with build_engine_config()")
        return self.model

    def tokenizer_folder(self) -> str:
        """Where the tokenizer comes from: --tokenizer, else the model folder."""
        return self.tokenizer or self.folder()

    def validate(self) -> None:
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if self.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'auto', got {self.dtype!r}")
        if self.quantization not in (None, "int8", "int4", "bf16", "fp16"):
            raise ValueError(f"quantization must be 'int8', 'int4', 'bf16' or 'fp16' (or None), "
                             f"got {self.quantization!r}")
        if self.activation_quant not in ACTIVATION_QUANTS:
            raise ValueError(f"activation_quant must be one of {', '.join(ACTIVATION_QUANTS)}, "
                             f"got {self.activation_quant!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.batch_invariant and self.activation_quant != "int16":
            raise ValueError("batch_invariant needs activation_quant int16 (the int8 activations' kernels take "
                             "another summation order at each batch size)")


@dataclass(slots=True)
class CacheConfig:
    # Tokens per KV block, also the prefix cache's unit (only whole blocks are reused).  8, not 16: a shared prefix
    # (a chat template's system prompt is ~24 tokens here) is reused up to 7 tokens closer to its end, and every
    # token not reused is a prefill row.  1.7B Q4_K_M, 16 chat requests, c=1, A/B A/B: TTFT p50 580-593 vs 786-834 ms,
    # tok/s 1.07x.  The decode attention computes each position's row address, so the block size costs it nothing.
    block_size: int = 8
    kv_cache_memory_gib: float = 1.0  # budget for the paged KV cache
    # "auto": the model's dtype; "float16": half the bytes of a float32 cache (twice the tokens per budget, half the
    # memory traffic of decode attention), K/V rounded to float16 as llama.cpp's default cache type does
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None  # tests: force a small cache
    # Automatic prefix caching: full blocks are shared by content hash between sequences (core/kv_cache_manager.py)
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        # (upper bounds: a block of 2^60 tokens or 10^18 GiB reached the allocator and failed after the model
        # loaded, with a traceback)
        if self.block_size < 1 or self.block_size & (self.block_size - 1) or self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be a power of two up to {MAX_BLOCK_SIZE}, got {self.block_size}")
        if not 0 < self.kv_cache_memory_gib <= MAX_KV_CACHE_GIB:  # (False for NaN)
            raise ValueError(f"kv_cache_memory must be > 0 and at most {MAX_KV_CACHE_GIB} GiB, "
                             f"got {self.kv_cache_memory_gib}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token budget per step; long prompts are chunked to fit
    enable_chunked_prefill: bool = True
    # Schedule and prepare step N+1 while step N runs (the engine core's stepper thread); see README for what it
    # buys here.  Off with speculative decoding, and step by step while a grammar or guided request runs.
    async_scheduling: bool = False

    def validate(self) -> None:
        if not 1 <= self.max_num_seqs <= MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be in [1, {MAX_NUM_SEQS}], got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


SPECULATIVE_METHODS = ("ngram", "draft")


# The defaults of the engine's cache and scheduler, read by the LLM API's and the CLI's own defaults (one source)
CACHE_DEFAULTS, SCHEDULER_DEFAULTS = CacheConfig(), SchedulerConfig()


@dataclass(slots=True)
class SpeculativeConfig:
    method: str | None = None  # None (off) | "ngram" | "draft"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    # method "draft": either a smaller local model with the target's tokenizer, or the target's own first
    # `draft_layers` layers + final norm + LM head (self-draft, no second model and no second KV cache).
    draft_model: str | None = None
    draft_layers: int | None = None
    # Per request, drafting goes on while the tokens its rounds emit (average, see spec_decode/policy.py) clear
    # this bar, plus num_speculative_tokens * (a draft forward's cost in plain steps) for a draft model.  Measured
    # on this CPU (bench/speculative.py): a k=4 verification step costs about two plain steps at batch 1 and
    # relatively more in a batch, so rounds that emit ~2 tokens lose.
    min_mean_emitted: float = 2.5
    min_mean_emitted_batched: float = 3.2  # the same bar when more than one request is running
    # The C decode kernels take a step of up to kernels/decoder.py MAX_TOKENS tokens; a step with more falls back to
    # torch GEMMs, estimated at this many plain steps (measured 2.6-3.4 at batch 8, k=4, when the kernels' limit was
    # 8 tokens): drafts that push a step there must be expected to emit that many times the batch's tokens.
    large_step_cost: float = 3.0
    adaptive: bool = True  # False: every eligible request drafts every step (tests; the raw cost of drafting)

    def validate(self) -> None:
        if self.method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} (or None), "
                             f"got {self.method!r}")
        if self.method and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.method == "ngram" and not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "draft":
            if (self.draft_model is None) == (self.draft_layers is None):
                raise ValueError("speculative method 'draft' needs exactly one of draft_model (a smaller model "
                                 "folder) or draft_layers (self-draft from the target's first layers)")
            if self.draft_layers is not None and self.draft_layers < 1:
                raise ValueError(f"draft_layers must be >= 1, got {self.draft_layers}")
        elif self.draft_model is not None or self.draft_layers is not None:
            raise ValueError("draft_model / draft_layers need speculative method 'draft'")


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    num_threads: int | None = None  # torch intra-op threads in the engine process (None: all cores)
    # Engine-core processes behind one frontend, each with its own KV cache (--data-parallel-size, vLLM's name).
    data_parallel_size: int = 1
    # Supervision (the frontend's side): an engine silent this long is hung (--engine-hang-timeout); a dead or hung
    # engine is restarted, or with engine_restart False (--no-engine-restart) the server exits non-zero.
    engine_hang_timeout_s: float = 30.0
    engine_restart: bool = True

    def validate(self) -> None:
        if not is_int(self.data_parallel_size) or not 1 <= self.data_parallel_size <= MAX_DATA_PARALLEL:
            raise ValueError(f"data_parallel_size must be an integer in [1, {MAX_DATA_PARALLEL}], "
                             f"got {self.data_parallel_size!r}")
        if self.num_threads is not None and (not is_int(self.num_threads) or not 1 <= self.num_threads <= MAX_THREADS):
            raise ValueError(f"num_threads must be an integer in [1, {MAX_THREADS}], got {self.num_threads!r}")
        if not 2.0 <= self.engine_hang_timeout_s <= 86400:
            raise ValueError(f"engine hang timeout must be 2..86400 s (the engine beats every second), "
                             f"got {self.engine_hang_timeout_s!r}")
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.speculative.validate()


def read_hf_config(path: Path) -> dict:
    """Reads config.json of a local model folder with errors that name the problem."""
    if path.is_file():  # (was "does not exist": a file there is no missing folder)
        raise ValueError(f"{path} is a file, not a model folder: a model is a Hugging Face model folder "
                         "(config.json, tokenizer, *.safetensors) or a GGUF file")
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist (tokenspout never downloads from a hub)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing: not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):  # (`[]` failed as an AttributeError naming nothing)
        raise ValueError(f"{cfg_file} must be a JSON object, got {type(cfg).__name__}")
    archs = cfg.get("architectures") or []
    # (a bare string was read letter by letter: "architecture 'LlamaForCausalLM' is not supported")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{cfg_file}: architectures must be a list of class names, got {archs!r}")
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"{path}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return cfg
