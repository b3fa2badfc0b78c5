#!/bin/sh
# genai-perf (NVIDIA's LLM benchmark client, a separate install) against a running deployment:
#   scripts/genai_perf.sh                          the router's OpenAI chat API (127.0.0.1:8080)
#   scripts/genai_perf.sh router 127.0.0.1:8080    the same, explicitly
#   scripts/genai_perf.sh triton 127.0.0.1:8001    the client-facing decode group's `llm` over Triton gRPC streaming
# Start a deployment first (make serve, or disagg launch CONFIG). Install genai-perf once:
#   python3.11 -m venv /tmp/gp && /tmp/gp/bin/pip install genai-perf==0.0.16
#   GENAI_PERF=/tmp/gp/bin/genai-perf scripts/genai_perf.sh
# genai-perf drives perf_analyzer (from this venv's tritonclient wheel; it needs libb64 and
# libcudart, which `orchestrator.triton.perf_analyzer_env` links from nvidia_pytriton.libs), and
# a tokenizer: the engine directory's, offline.
set -eu
KIND=${1:-router}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$ROOT/.venv/bin/python"
ENGINE=$("$PY" -c "from builders.build import DEFAULT_ENGINE_CACHE, default_engine_dir; from builders import BuildOptions; from torch_engine.config import DType, Role; print(default_engine_dir(DEFAULT_ENGINE_CACHE, 'smollm2', BuildOptions(role=Role.DECODE, dtype=DType.FLOAT32)))")
LIBS=$("$PY" -c "from pathlib import Path; from orchestrator.triton import TritonInstall, perf_analyzer_env; print(perf_analyzer_env(TritonInstall.find(), Path('$ROOT/runs/pa-libs'))['LD_LIBRARY_PATH'])")
export LD_LIBRARY_PATH="$LIBS"
export PATH="$ROOT/.venv/bin:$PATH"   # perf_analyzer
export HF_HUB_OFFLINE=1
COMMON="--streaming --tokenizer $ENGINE --synthetic-input-tokens-mean 160 --synthetic-input-tokens-stddev 0
  --output-tokens-mean 64 --extra-inputs ignore_eos:true --concurrency 2 --request-count 8"
case "$KIND" in
  router)
    # shellcheck disable=SC2086
    "${GENAI_PERF:-genai-perf}" profile -m smollm2 --endpoint-type chat -u "${2:-127.0.0.1:8080}" $COMMON \
      --artifact-dir "$ROOT/runs/genai-perf-router" ;;
  triton)
    # shellcheck disable=SC2086
    "${GENAI_PERF:-genai-perf}" profile -m llm --endpoint-type kserve --backend tensorrtllm -u "${2:-127.0.0.1:8001}" \
      $COMMON --artifact-dir "$ROOT/runs/genai-perf" ;;
  *) echo "usage: $0 [router|triton] [URL]" >&2; exit 2 ;;
esac
