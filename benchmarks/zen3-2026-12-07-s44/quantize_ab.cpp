// The activations' quantization (qgemm.h's quantize_rows) of two versions of the header in one process (session 44,
// AVX2-only Zen 3): whether every quant, scale and sum is the same, and the time of 256 x 1536 values each.
//
//   git show 8067530~1:torch_engine/csrc/qgemm.h > /tmp/qgemm_head.h   # the plain loop on AVX2
//   g++ -O3 -march=native -std=c++17 -ffast-math -fno-finite-math-only -I. -Itorch_engine/csrc \
//       -DOLD='"/tmp/qgemm_head.h"' -DNEW='"torch_engine/csrc/qgemm.h"' -o /tmp/quantize_ab \
//       benchmarks/zen3-2026-12-07-s44/quantize_ab.cpp && taskset -c 1 /tmp/quantize_ab
// (An executable built with -ffast-math flushes subnormals to zero, so its subnormal block reads as zeros here; the
// Python process does not, which is where tests/test_int8_kernels.py found the subnormal scales' overflow.)
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <utility>
#include "torch_engine/csrc/cpu_vendor.h"
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include <cmath>
#include <algorithm>
namespace A {
#include OLD
}
namespace B {
#include NEW
}
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  std::mt19937 rng(5);
  const int64_t R = 256, K = 1536, NB = K / 32;
  std::vector<float> x(R * K);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& v : x) v = nd(rng) * std::exp(nd(rng) * 3);
  for (int i = 0; i < 32; ++i) x[i] = 0.0f;               // an all-zero block
  for (int i = 32; i < 64; ++i) x[i] = (i % 2 ? 1e-40f : -3e-39f);  // subnormals
  x[100] = 127.5f; x[101] = -127.5f;
  std::vector<int8_t> qa(R * K), qb(R * K);
  std::vector<float> dxa(R * NB), dxb(R * NB), dxsa(R * NB), dxsb(R * NB), dla(R * NB), dlb(R * NB);
  std::vector<int32_t> sa(R * NB), sb(R * NB), la(R * NB), lb(R * NB);
  A::disagg_q::quantize_rows(x.data(), 0, R, K, qa.data(), dxa.data(), sa.data(), dxsa.data(), la.data(), dla.data());
  B::disagg_q::quantize_rows(x.data(), 0, R, K, qb.data(), dxb.data(), sb.data(), dxsb.data(), lb.data(), dlb.data());
  long bad = 0;
  for (int64_t i = 0; i < R * K; ++i) bad += qa[i] != qb[i];
  for (int64_t i = 0; i < R * NB; ++i) bad += dxa[i] != dxb[i] || sa[i] != sb[i] || dxsa[i] != dxsb[i] || la[i] != lb[i] || dla[i] != dlb[i];
  std::printf("mismatches: %ld\n", bad);
  for (int round = 0; round < 3; ++round) {
    double t = now();
    for (int k = 0; k < 20; ++k) A::disagg_q::quantize_rows(x.data(), 0, R, K, qa.data(), dxa.data(), sa.data(), dxsa.data(), la.data(), dla.data());
    double ta = (now() - t) / 20; t = now();
    for (int k = 0; k < 20; ++k) B::disagg_q::quantize_rows(x.data(), 0, R, K, qb.data(), dxb.data(), sb.data(), dxsb.data(), lb.data(), dlb.data());
    double tb = (now() - t) / 20;
    std::printf("256 x 1536: old %.3f ms (%.2f ns/value), new %.3f ms (%.2f ns/value): %.2fx\n", ta * 1e3, ta * 1e9 / (R * K), tb * 1e3, tb * 1e9 / (R * K), ta / tb);
  }
}
