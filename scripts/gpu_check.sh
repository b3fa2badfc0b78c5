#!/usr/bin/env bash
# The CUDA checks, in one run on a GPU machine, from the source tree (nothing installed but what the
# machine has: torch + transformers; pydantic and gguf may come as wheels on PYTHONPATH):
#   1. the engine's tests on cuda (equivalence on the reference, packed and decode-graph paths;
#      decode-graph capture with the layer counter inside; HF equality of tiny models; speculative
#      decoding) — TESTS_ONLY=1 stops after them;
#   2. `bench engine` on cuda for a SmolLM2-shaped model (random weights), decode graphs on and off.
# Usage: OUT=dir scripts/gpu_check.sh     (results: OUT/*.log, OUT/*.json)
set -uo pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider --device cuda -o addopts="" \
  tests/test_decode_graphs.py tests/test_engine_equivalence.py tests/test_split_request.py \
  tests/test_models_vs_hf.py tests/test_layer_progress.py tests/test_bad_input.py tests/test_churn.py \
  tests/test_speculative.py tests/test_mtp.py -k "not smollm2 and not trained_head" \
  2>&1 | tee "$OUT/tests-cuda.log" | tail -25
[ "${TESTS_ONLY:-0}" = 1 ] && exit 0
python3 scripts/shaped_checkpoint.py "$OUT/smol-hf" >/dev/null
python3 - "$OUT" <<'PY'
import sys
from pathlib import Path
from builders import BuildOptions, build_engine
from torch_engine.config import DType
out = Path(sys.argv[1])
print(build_engine(str(out / "smol-hf"), out / "smol-engine", BuildOptions(dtype=DType.BFLOAT16, page_size=16), progress=False))
PY
for graphs in on off; do
  timeout 120 python3 -m bench.engine --engine "$OUT/smol-engine" --device cuda --run-dtype bfloat16 --threads 1 \
    --batch 1 4 16 64 --repeats 3 --decode-graphs $graphs --json "$OUT/bench-cuda-graphs-$graphs.json" \
    2>&1 | grep -v Warning | tee "$OUT/bench-cuda-graphs-$graphs.log"
done
rm -rf "$OUT/smol-hf" "$OUT/smol-engine"
