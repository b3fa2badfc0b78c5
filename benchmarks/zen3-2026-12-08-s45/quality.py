"""Perplexity of the fixed text (``bench/data/perplexity-long.txt``) on the fast path with the KV pages in the
compute dtype and in bf16, the decode path (one token a step: every score read from the pages) and the prefill
path (16-token chunks), plus the share of positions whose top token is the same; the embedded SmolLM2, ``auto``.
Session 36's quality.py with the reference's pages named (fp32): since session 45 an fp32 CPU's ``auto`` defaults to
bf16 pages, so None no longer means fp32 there (quality.txt of this folder)."""

from __future__ import annotations

import argparse
import math

from bench.quality import LONG_TEXT, perplexity, prompt_logprobs, top1_agreement
from builders.arguments import engine_dir_of, engine_source_arguments
from torch_engine.config import DType, EngineConfig, SchedulerConfig
from torch_engine.engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    engine_source_arguments(p)
    p.add_argument("--tokens", type=int, default=1024)
    a = p.parse_args()

    def engine(kv: DType, chunk: int) -> LLMEngine:
        sched = SchedulerConfig(max_prefill_chunk=chunk, max_num_batched_tokens=max(chunk, 16))
        cfg = EngineConfig(engine_dir=engine_dir_of(a), dtype="auto", kv_dtype=kv, num_pages=a.tokens // 4,
                           scheduler=sched)  # fmt: skip
        return LLMEngine(cfg)

    ref = engine(DType.FLOAT32, 16)
    assert ref.tokenizer is not None
    ids = ref.tokenizer.encode(LONG_TEXT.read_text(encoding="utf-8"))[: a.tokens]
    print(f"# {len(ids)} tokens; {ref.describe().kernel_path}", flush=True)
    chunks = {kv: prompt_logprobs(engine(kv, 16), ids, top=1) for kv in (DType.FLOAT32, DType.BFLOAT16)}
    for kv in (DType.FLOAT32, DType.BFLOAT16):
        name = f"{'bf16' if kv == DType.BFLOAT16 else 'fp32'} pages"
        decode = perplexity(engine(kv, 1), ids)
        lps = chunks[kv]
        prefill = math.exp(-sum(x.logprob for x in lps) / len(lps))
        print(f"{name}: perplexity decode path {decode:.4f}, prefill path (16-token chunks) {prefill:.4f}", flush=True)
    same = top1_agreement(chunks[DType.FLOAT32], chunks[DType.BFLOAT16])
    print(f"top-1 agreement bf16 vs fp32 pages (16-token chunks): {same:.4f}")


if __name__ == "__main__":
    main()
