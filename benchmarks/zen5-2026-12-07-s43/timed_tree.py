"""Copy a source tree's kernels with a timer after each barrier of the fused decode step's layer loop (thread 0).

Session 42's phases.txt came from such a build that was not kept; this makes it again from any tree. The copy prints,
every ``EVERY`` fused steps, the ms per step of each phase summed over the layers (names in barrier order), then resets.

    .venv/bin/python benchmarks/zen5-2026-12-07-s43/timed_tree.py . /tmp/wt-timed
    .venv/bin/python benchmarks/xeon-2026-12-07-s40/build_named.py /tmp/wt-timed dck_timed /tmp/build_timed
    taskset -c 1 .venv/bin/python benchmarks/xeon-2026-12-07-s42/phases.py --threads 1 --batch 1 8 16 \
        --kernels /tmp/build_timed/dck_timed.so
"""

import shutil
import sys
from pathlib import Path

NAMES = ["norm+q", "qkv", "rope+kv", "attn", "merge+q", "o", "norm+q", "gate_up", "silu+q", "down"]
EVERY = 40

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
(dst / "torch_engine").mkdir(parents=True, exist_ok=True)
shutil.copytree(src / "torch_engine" / "csrc", dst / "torch_engine" / "csrc", dirs_exist_ok=True)
path = dst / "torch_engine" / "csrc" / "decode_step.cpp"
text = path.read_text()
loop = "      for (size_t li = 0; li < layers_.size(); ++li) {\n"
end = "      for (int64_t r = r0; r < r1; ++r) rms_norm(x + r * H, final_norm_.data_ptr<float>()"
assert text.count(loop) == 1 and text.count(end) == 1
head, rest = text.split(loop)
body, tail = rest.split(end)
parts = body.split("#pragma omp barrier\n")
assert len(parts) == len(NAMES) + 1, len(parts)
timed = parts[0]
for k, part in enumerate(parts[1:]):
    stamp = f"if (t == 0) {{ const double n_ = ph_now(); ph_acc[{k}] += n_ - ph_t; ph_t = n_; }}"
    timed += f"#pragma omp barrier\n        {stamp}\n"
    timed += part
start = "      if (t == 0) ph_t = ph_now();\n"
names = ", ".join(f'"{n}"' for n in NAMES)
report = (
    "      if (t == 0 && ++ph_calls % " + str(EVERY) + " == 0) {\n"
    f"        static const char* names[] = {{{names}}};\n"
    '        double total = 0; std::printf("B=%lld per step:", static_cast<long long>(B));\n'
    f'        for (int k = 0; k < {len(NAMES)}; ++k) {{ std::printf(" %s %.2f", names[k], 1e3 * ph_acc[k] / {EVERY});'
    " total += ph_acc[k]; ph_acc[k] = 0; }\n"
    f'        std::printf(" | total %.2f ms\\n", 1e3 * total / {EVERY}); std::fflush(stdout);\n'
    "      }\n"
)
prelude = (
    "#include <chrono>\n#include <cstdio>\n"
    "static double ph_acc[16];\nstatic double ph_t;\nstatic long ph_calls;\n"
    "static double ph_now() { return std::chrono::duration<double>("
    "std::chrono::steady_clock::now().time_since_epoch()).count(); }\n"
)
path.write_text(prelude + head + start + loop + timed + report + end + tail)
print(path)
