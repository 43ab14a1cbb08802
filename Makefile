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

.PHONY: setup setup-agents setup-cluster setup-browser test test-all lint format serve models clean llama-bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

models: setup
	$(BIN)/specserve models pull qwen2.5-coder-0.5b

# the default model with the default speculation (ngram-map-k,suffix,prediction) and 4 slots; `exec` makes
# the server make's own child, so SIGTERM to make (which make passes on) reaches it and it drains
serve: setup models
	exec $(BIN)/specserve serve --host $(HOST) --port $(PORT) $(ARGS)

# instructor, for tests/real/test_agents_real.py (its own extra: it pins jiter below openai's);
# installed without its pins, which it runs with
setup-agents: setup
	$(BIN)/python -m pip install -q --disable-pip-version-check aiohttp docstring-parser \
		tenacity regex requests rich typer
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps 'instructor>=1.17,<2'

# Ray Serve, for `specserve serve --replicas N` and its tests (docs/scaling.md)
setup-cluster: setup
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[cluster]'

# Debian's chromium and its chromedriver, for the chat page's browser tests
# (tests/server/test_webui_browser.py); apt runs only when one of them is missing
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
setup-browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "setup-browser: $$(command -v chromium), $$(command -v chromedriver)"; \
	else \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y \
			chromium chromium-driver; \
	fi

# the default suite: tiny models everywhere, plus the smoke subset of real-model and Ray tests
test: setup setup-browser setup-cluster models lint
	$(BIN)/python -m pytest -q -m "not slow or smoke"

# everything, real-model tests included (pulls what they need)
test-all: setup models
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check specserve tests
	$(BIN)/ruff format --check specserve tests
	$(BIN)/mypy specserve
	$(BIN)/lint-imports

format: setup
	$(BIN)/ruff format specserve tests
	$(BIN)/ruff check --fix specserve tests

# llama.cpp's llama-bench, for `specserve bench decode --llama-bench` (llama.cpp on the same GGUF
# files in the same run). No package ships the binary; llama-cpp-python's source distribution
# on PyPI carries llama.cpp's source, so it is built from that (~40 min on 2 cores).
LLAMA_CPP_PY := 0.3.36
LLAMA_DIR ?= $(HOME)/.cache/specserve/llama.cpp-$(LLAMA_CPP_PY)
LLAMA_BENCH := $(LLAMA_DIR)/build/bin/llama-bench
LLAMA_FLAGS := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF

llama-bench: $(LLAMA_BENCH)
	@echo "llama-bench: $(LLAMA_BENCH)"

$(LLAMA_BENCH): | setup
	command -v cmake >/dev/null || $(BIN)/python -m pip install -q cmake
	mkdir -p $(LLAMA_DIR)
	$(BIN)/python -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
		llama-cpp-python==$(LLAMA_CPP_PY) -d $(LLAMA_DIR)
	tar xzf $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C $(LLAMA_DIR) \
		--strip-components=3 llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
	PATH="$(abspath $(BIN)):$$PATH" cmake -S $(LLAMA_DIR) -B $(LLAMA_DIR)/build $(LLAMA_FLAGS)
	PATH="$(abspath $(BIN)):$$PATH" cmake --build $(LLAMA_DIR)/build --target llama-bench -j$$(nproc)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
