#!/usr/bin/env bash
# The planner on published GPU figures (BENCHMARKS.md "Planner vs the seeds"): DeepSeek-R1 on 8-GPU
# H200 / H100 nodes (Perplexity's report), and Llama-3.1-70B with H100 prefill + L40S decode (seed 004).
set -euo pipefail
OUT=${1:-runs/plan}
mkdir -p "$OUT"
PLAN=".venv/bin/disagg plan"
R1=configs/planner/deepseek-r1.json
L70=configs/planner/llama-3.1-70b.json
# R1: search-style prompts (long retrieved context), answers of a few hundred tokens; SLO 50 tok/s per request
for gpu in H200 H100; do
  $PLAN --model $R1 --gpu $gpu --devices 32 --tp 8 16 24 32 --input lognormal:8000:0.5 --output 300-700 \
    --requests 300 --ttft-slo 3 --tpot-slo 0.02 --handover prefill-token --chunk 8192 --rate 4 \
    --json "$OUT/r1-$gpu.json" --plot "$OUT/r1-$gpu.png"
done
# seed 004: H100 prefill, L40S decode (FP8 weights); colocated on each kind for comparison
$PLAN --model $L70 --prefill-gpu H100 --decode-gpu L40S --devices 16 --tp 2 4 8 --input lognormal:3000:0.6 \
  --output 100-400 --requests 300 --ttft-slo 2 --tpot-slo 0.05 --handover prefill-token --chunk 4096 \
  --json "$OUT/seed004.json" --plot "$OUT/seed004.png"
