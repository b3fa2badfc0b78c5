#!/bin/bash
# The engine's decode step, this tree against another (a git worktree), alternated processes: the median of 48
# steps after B prompts of 256 tokens (llama.cpp's Q4_K_M of SmolLM2), at T threads.
#   git worktree add /tmp/old REV && (cd /tmp/old && PYTHONPATH=/tmp/old /work/main/.venv/bin/python -m torch_engine.kernels)
#   benchmarks/wide-tiles-2026-12-05/step_ab.sh /tmp/old MODEL.gguf PAIRS "16 1" "16 2" "24 1"
old=$1; model=$2; pairs=$3; shift 3
here=$(cd "$(dirname "$0")/../.." && pwd)
step() {  # PYTHONPATH B T
  PYTHONPATH=$1 "$here/.venv/bin/python" "$here/benchmarks/wide-tiles-2026-12-05/step.py" --model "$model" --batch "$2" \
    --threads "$3" | tail -1
}
for cfg in "$@"; do
  read -r B T <<< "$cfg"
  for _ in $(seq "$pairs"); do
    o=$(step "$old" "$B" "$T"); n=$(step "$here" "$B" "$T")
    echo "batch $B threads $T: old $o ms, new $n ms, old / new $(python3 -c "print(round($o / $n, 3))")"
  done
done
