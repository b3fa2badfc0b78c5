// The integer GEMM of two versions of torch_engine/csrc/qgemm.h alternated in one process (one thread, best of 15
// rounds each), on random weights of SmolLM2's shapes: GMAC/s old -> new and the ratio at 1-64 rows, and whether the
// two results differ ("!DIFF": more than 1e-4 relative). A noisy VM moved absolute rates by up to 1.5x between runs;
// alternating in one process keeps the ratio. Session 39 (AVX2-only Zen 3), gemm_ab.txt:
//
//   git show 471103c:torch_engine/csrc/qgemm.h > /tmp/qgemm_old.h   # the header before a3ea3d0
//   g++ -O3 -march=native -std=c++17 -ffast-math -fno-finite-math-only -I. -Itorch_engine/csrc -DOLD='"/tmp/qgemm_old.h"' \
//       -DNEW='"torch_engine/csrc/qgemm.h"' -o /tmp/gemm_ab benchmarks/zen3-2026-12-06-s39/gemm_ab.cpp
//   taskset -c 1 /tmp/gemm_ab
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

// Since session 44 both header versions may share the vendor check (cpu_vendor.h): included once here, at global
// scope, so that a header included inside namespace A or B finds it already defined (-Itorch_engine/csrc lets a copy
// of a header outside the tree find it too).
#if __has_include("torch_engine/csrc/cpu_vendor.h")
#include "torch_engine/csrc/cpu_vendor.h"
#endif
namespace A {
#include OLD
}
namespace B {
#include NEW
}

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Case {
  int kind;
  int64_t N, K;
  const char* name;
};

int main() {
  const Case cases[] = {{3, 3072, 576, "gate_up Q4_1"}, {3, 576, 1536, "down Q4_1"}, {2, 3072, 576, "gate_up Q4_0"},
                        {12, 576, 1536, "down Q4_K"},   {7, 576, 1536, "down Q5_1"}, {8, 49152, 576, "lm_head Q8_0"}};
  const int rows[] = {1, 2, 4, 8, 16, 64};
  for (const Case& cs : cases) {
    std::printf("%-13s", cs.name);
    for (int R : rows) {
      std::mt19937 rng(1);
      const int64_t N = cs.N, K = cs.K, NB = K / 32;
      A::disagg_q::Q16 wa;
      wa.kind = static_cast<A::disagg_q::Kind>(cs.kind);
      wa.N = N;
      wa.K = K;
      std::vector<uint8_t> qs(wa.groups() * wa.group_bytes());
      for (auto& b : qs) b = static_cast<uint8_t>(rng());
      std::vector<uint16_t> d(wa.groups() * wa.d_blocks() * 16), m(wa.groups() * NB * 16 * 2);
      for (auto& v : d) v = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));
      for (auto& v : m) v = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));
      wa.qs = qs.data();
      wa.d = d.data();
      wa.m = m.data();
      B::disagg_q::Q16 wb;
      wb.kind = static_cast<B::disagg_q::Kind>(cs.kind);
      wb.N = N;
      wb.K = K;
      wb.qs = qs.data();
      wb.d = d.data();
      wb.m = m.data();
      std::vector<float> xf(R * K);
      for (auto& v : xf) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
      std::vector<int8_t> q(R * K);
      std::vector<float> dx(R * NB), dxs(R * NB), dxlo(R * NB);
      std::vector<int32_t> s(R * NB), slo(R * NB);
      A::disagg_q::quantize_rows(xf.data(), 0, R, K, q.data(), dx.data(), s.data(), dxs.data(), slo.data(), dxlo.data());
      A::disagg_q::ActQ8 xa{q.data(), dx.data(), s.data(), dxs.data(), slo.data(), dxlo.data(), K};
      B::disagg_q::ActQ8 xb{q.data(), dx.data(), s.data(), dxs.data(), slo.data(), dxlo.data(), K};
      std::vector<float> ya(R * N), yb(R * N);
      const int reps = static_cast<int>(std::max<int64_t>(2, static_cast<int64_t>(3e8 / static_cast<double>(N * K * R))));
      double ta = 1e9, tb = 1e9;
      for (int round = 0; round < 15; ++round) {
        double t = now();
        for (int i = 0; i < reps; ++i) A::disagg_q::gemm_groups(wa, xa, R, 0, wa.groups(), ya.data(), N, nullptr);
        ta = std::min(ta, (now() - t) / reps);
        t = now();
        for (int i = 0; i < reps; ++i) B::disagg_q::gemm_groups(wb, xb, R, 0, wb.groups(), yb.data(), N, nullptr);
        tb = std::min(tb, (now() - t) / reps);
      }
      double maxd = 0;
      for (int64_t i = 0; i < R * N; ++i)
        maxd = std::max(maxd, static_cast<double>(std::fabs(ya[i] - yb[i]) / (1e-3 + std::fabs(ya[i]))));
      const double macs = static_cast<double>(N * K * R) / 1e9;
      std::printf(" %d: %5.1f->%5.1f (%.2fx)%s", R, macs / ta, macs / tb, ta / tb, maxd > 1e-4 ? "!DIFF" : "");
    }
    std::printf("\n");
    std::fflush(stdout);
  }
}
