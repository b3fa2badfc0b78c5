"""The prefill attention on bf16 pages and bf16 queries (a bf16 engine's prefill) of two builds of the CPU kernels,
alternated in one process, one thread, best of 7 each: SmolLM2's heads (9 query, 3 KV, D 64), 16-token pages in
shuffled order, one layer, L tokens from position 0. Session 41 (Emerald Rapids Xeon), prefill_ab.txt: old = e417fc8's
kernels (vdpbf16ps on every CPU with AVX-512 BF16), new = the fp32 kernel on Intel's cores. Each output's largest
difference from a float64 softmax over the same bf16 values is printed too.

    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py /tmp/wt-old dck_old /tmp/build_old
    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py . dck_pf /tmp/build_pf
    taskset -c 1 .venv/bin/python benchmarks/xeon-2026-12-07-s41/prefill_ab.py /tmp/build_old/dck_old.so \\
        /tmp/build_pf/dck_pf.so
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "xeon-2026-12-07-s40"))
from step_ab import load

torch.set_num_threads(1)
old, new = load(sys.argv[1]), load(sys.argv[2])
H, G, D, P = 3, 3, 64, 16
torch.manual_seed(0)
for L in (128, 256, 512, 1024, 2048):
    pages = (L + P - 1) // P
    pool = (torch.randn(pages * 2, H, 2, P, D) * 0.5).to(torch.bfloat16)
    table = torch.randperm(pages * 2)[:pages].long()
    q = torch.randn(L, H * G, D).to(torch.bfloat16)
    args = (pool, table, 0, H, H * 2 * P * D, 2 * P * D, P * D, D, P, D**-0.5)
    best = [1e9, 1e9]
    for r in range(7):
        for i, k in enumerate((old, new) if r % 2 == 0 else (new, old)):
            w = i if r % 2 == 0 else 1 - i
            t = time.perf_counter()
            k.paged_prefill_attention(q, *args)
            best[w] = min(best[w], time.perf_counter() - t)
    kv = pool[table].double()  # [pages, H, 2, P, D] -> per head [L, D]
    keys = kv[:, :, 0].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :L]
    vals = kv[:, :, 1].permute(1, 0, 2, 3).reshape(H, -1, D)[:, :L]
    qd = q.double().view(L, H, G, D)
    s = torch.einsum("lhgd,htd->hglt", qd, keys) * D**-0.5
    s = s.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("hglt,htd->lhgd", s.softmax(-1), vals).reshape(L, H * G, D)
    err = [(k.paged_prefill_attention(q, *args).double() - ref).abs().max().item() for k in (old, new)]
    print(
        f"L={L}: old {best[0] * 1e3:.2f} ms, new {best[1] * 1e3:.2f} ms a layer ({best[0] / best[1]:.3f}x); "
        f"largest error vs float64: old {err[0]:.2e}, new {err[1]:.2e}"
    )
