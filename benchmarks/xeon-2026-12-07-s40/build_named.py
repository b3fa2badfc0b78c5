"""Build a source tree's CPU kernels under another extension name, so that two builds load in one process
(CPython keeps one module per extension name: a second build of ``disagg_cpu_kernels`` loads as the first).

    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py /tmp/wt-old dck_old /tmp/build_old
"""

import sys
from pathlib import Path

from torch.utils.cpp_extension import load

import torch_engine.kernels as tk

tree, name, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
sources = [str(tree / "torch_engine" / "csrc" / Path(p).name) for p in tk.SOURCES]
module = load(
    name=name, sources=sources, build_directory=str(out), extra_cflags=tk._flags("native"), extra_ldflags=["-fopenmp"]
)
print(module.__file__)
