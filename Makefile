# specserve: `make serve` sets up and serves the default model; `make test` sets up and tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is installed first and pinned: on these machines 2.13.0 is a local CPU build, while an
# unpinned torch pulls several GB of CUDA packages.
TORCH := torch==2.13.0
# `make serve HOST=0.0.0.0 PORT=9000 ARGS="-np 2"`: where to listen, and any other serve flags
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=

.PHONY: setup test test-all lint format serve models clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

models: setup
	$(BIN)/specserve models pull qwen2.5-coder-0.5b

# the default model with the default speculation (ngram-map-k,suffix) and 4 slots; `exec` makes
# the server make's own child, so SIGTERM to make (which make passes on) reaches it and it drains
serve: setup models
	exec $(BIN)/specserve serve --host $(HOST) --port $(PORT) $(ARGS)

# the default suite: tiny models everywhere, plus the smoke subset of real-model tests
test: setup models lint
	$(BIN)/python -m pytest -q -m "not slow or smoke"

# everything, real-model tests included (pulls what they need)
test-all: setup models
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check specserve tests
	$(BIN)/ruff format --check specserve tests
	$(BIN)/mypy specserve

format: setup
	$(BIN)/ruff format specserve tests
	$(BIN)/ruff check --fix specserve tests

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
