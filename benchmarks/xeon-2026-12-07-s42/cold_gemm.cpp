// A model's integer GEMMs (SmolLM2's shapes as the embedded file holds them: 30 layers of Q4_1 QKV, O, gate_up and
// down, distinct random weights, and the Q8_0 lm_head; 96.4 MB) at R = 1, 4, 8 and 16 rows, two versions of
// torch_engine/csrc/qgemm.h alternated in one process, one thread. `copies` copies of the model cycled (1: the
// weights may stay in this Xeon's 260 MB L3; 3: 289 MB, read from DRAM). Session 42 used it with one header twice
// but for the prefetch distance at 4+ rows (8 -> 16 blocks: no clear change) and to see how far the GEMMs are from
// flat over rows (cold_gemm.txt).
//
//   g++ -O3 -march=native -std=c++17 -ffast-math -fno-finite-math-only -I. -Itorch_engine/csrc -DOLD='"/tmp/qgemm_old.h"' \
//       -DNEW='"torch_engine/csrc/qgemm.h"' -o /tmp/cold benchmarks/xeon-2026-12-07-s42/cold_gemm.cpp
//   taskset -c 1 /tmp/cold 1 9; taskset -c 1 /tmp/cold 3 7    # copies rounds
// A model's worth of GEMMs (SmolLM2's shapes, 30 layers, distinct weights) at R rows, two headers alternated.
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <utility>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
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
struct W { int kind; int64_t N, K; std::vector<uint8_t> qs; std::vector<uint16_t> d, m; };
template <class Q> Q mk(const W& w) { Q q; q.kind = static_cast<decltype(q.kind)>(w.kind); q.N = w.N; q.K = w.K; q.qs = w.qs.data(); q.d = w.d.data(); q.m = w.m.data(); return q; }
int main(int argc, char** argv) {
  const int copies = argc > 1 ? atoi(argv[1]) : 1;
  const int rounds = argc > 2 ? atoi(argv[2]) : 9;
  std::mt19937 rng(1);
  std::vector<W> ws;
  for (int c = 0; c < copies; ++c) {
    for (int l = 0; l < 30; ++l) {
      const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
      for (auto& s : shapes) ws.push_back({3, s[0], s[1], {}, {}, {}});
    }
    ws.push_back({8, 49152, 576, {}, {}, {}});
  }
  size_t bytes = 0;
  for (auto& w : ws) {
    A::disagg_q::Q16 q; q.kind = static_cast<A::disagg_q::Kind>(w.kind); q.N = w.N; q.K = w.K;
    w.qs.resize(q.groups() * q.group_bytes());
    for (size_t i = 0; i < w.qs.size(); i += 4) { uint32_t r = rng(); std::memcpy(&w.qs[i], &r, 4); }
    w.d.resize(q.groups() * q.d_blocks() * 16); w.m.resize(q.groups() * q.NB() * 16 * 2);
    for (auto& v : w.d) v = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));
    for (auto& v : w.m) v = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));
    bytes += w.qs.size() + 2 * w.d.size() + (w.kind == 3 ? 2 * w.d.size() : 0);
  }
  std::printf("weights %.1f MB a copy, %d copies\n", bytes / 1e6 / copies, copies);
  const int rows[] = {1, 4, 8, 16};
  for (int R : rows) {
    const int64_t KM = 1536;
    std::vector<float> xf(R * KM);
    for (auto& v : xf) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
    std::vector<int8_t> q(R * KM); std::vector<float> dx(R * KM / 32), dxs(R * KM / 32), dxlo(R * KM / 32);
    std::vector<int32_t> s(R * KM / 32), slo(R * KM / 32);
    std::vector<float> y(R * 49152);
    double ta = 1e9, tb = 1e9; std::vector<double> ratios;
    auto pass = [&](auto tag) {
      using NS = decltype(tag);
      for (auto& w : ws) {
        auto qw = mk<typename NS::Q>(w);
        NS::quant(xf.data(), R, w.K, q.data(), dx.data(), s.data(), dxs.data(), slo.data(), dxlo.data());
        typename NS::X xa{q.data(), dx.data(), s.data(), dxs.data(), slo.data(), dxlo.data(), w.K};
        NS::gemm(qw, xa, R, y.data(), w.N);
      }
    };
    struct TA { using Q = A::disagg_q::Q16; using X = A::disagg_q::ActQ8;
      static void quant(const float* x, int R, int64_t K, int8_t* q, float* dx, int32_t* s, float* dxs, int32_t* slo, float* dxlo) { A::disagg_q::quantize_rows(x, 0, R, K, q, dx, s, dxs, slo, dxlo); }
      static void gemm(const Q& w, const X& x, int R, float* y, int64_t N) { A::disagg_q::gemm_groups(w, x, R, 0, w.groups(), y, N, nullptr); } };
    struct TB { using Q = B::disagg_q::Q16; using X = B::disagg_q::ActQ8;
      static void quant(const float* x, int R, int64_t K, int8_t* q, float* dx, int32_t* s, float* dxs, int32_t* slo, float* dxlo) { B::disagg_q::quantize_rows(x, 0, R, K, q, dx, s, dxs, slo, dxlo); }
      static void gemm(const Q& w, const X& x, int R, float* y, int64_t N) { B::disagg_q::gemm_groups(w, x, R, 0, w.groups(), y, N, nullptr); } };
    pass(TA{}); pass(TB{});
    for (int r = 0; r < rounds; ++r) {
      double t0 = now(); if (r % 2) { pass(TB{}); } else { pass(TA{}); } double t1 = now();
      if (r % 2) { pass(TA{}); } else { pass(TB{}); } double t2 = now();
      double a = r % 2 ? (t2 - t1) : (t1 - t0), b = r % 2 ? (t1 - t0) : (t2 - t1);
      ta = std::min(ta, a / copies); tb = std::min(tb, b / copies); ratios.push_back(a / b);
    }
    std::sort(ratios.begin(), ratios.end());
    std::printf("R=%2d  old %.2f ms  new %.2f ms a model  (%.1f / %.1f GB/s)  old/new median %.3f [%.3f-%.3f]\n", R, ta * 1e3, tb * 1e3,
                bytes / copies / ta / 1e9, bytes / copies / tb / 1e9, ratios[ratios.size() / 2], ratios.front(), ratios.back());
    std::fflush(stdout);
  }
}
