// The decode attention (attend_range) of two versions of torch_engine/csrc/attention.h alternated in one process, one
// thread, best of R rounds each, on fp32 pages and on bf16 pages (the same values rounded): SmolLM2's heads (3 KV heads
// of 64, 3 query heads each), S sequences of T tokens on 16-token pages in shuffled order, 30 layers; "dram": each layer
// its own pool (214 MB of fp32 at 16 x 290 tokens), "hot": every layer on the first one's pool. Prints each version's
// ms for both page dtypes, the ratios, and the largest difference of the normalised outputs (old fp32 pages vs each).
// Session 45 (AVX2-only Zen 3):
//
//   git show f09a2a1:torch_engine/csrc/attention.h > /tmp/attention_old.h
//   g++ -O3 -march=native -ffast-math -fno-finite-math-only -std=c++17 -I. -Itorch_engine/csrc
//       -I.venv/lib/python3.11/site-packages/torch/include -DOLD='"/tmp/attention_old.h"'
//       -DNEW='"torch_engine/csrc/attention.h"' -o /tmp/attention_ab benchmarks/zen3-2026-12-08-s45/attention_ab.cpp
//   taskset -c 1 /tmp/attention_ab dram [T] [S] [rounds]; taskset -c 1 /tmp/attention_ab hot [T] [S] [rounds]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "torch_engine/csrc/cpu_vendor.h"
namespace A {
#include OLD
}
namespace B {
#include NEW
}
#if defined(ALT)
namespace C {
#include ALT
}
#endif

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const int64_t H = 3, G = 3, D = 64, P = 16, L = 30;
  const bool hot = argc > 1 && argv[1][0] == 'h';
  const int64_t T = argc > 2 ? std::atoi(argv[2]) : 290;
  const int64_t S = argc > 3 ? std::atoi(argv[3]) : 16;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 15;
  const int64_t pages_per_seq = (T + P - 1) / P, NP = S * pages_per_seq;
  const int64_t page_stride = H * 2 * P * D, head_stride = 2 * P * D, kv_stride = P * D, token_stride = D;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  const int64_t nl = hot ? 1 : L;
  // 64-byte aligned pools, as torch allocates them (malloc's 16-byte alignment splits every other 32-byte load)
  std::vector<std::vector<float>> pfs(nl, std::vector<float>(NP * page_stride + 16));
  std::vector<std::vector<at::BFloat16>> pbs(nl, std::vector<at::BFloat16>(NP * page_stride + 32));
  std::vector<float*> pf(nl);
  std::vector<at::BFloat16*> pb(nl);
  for (int64_t i = 0; i < nl; ++i) {
    pf[i] = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(pfs[i].data()) + 63) & ~uintptr_t{63});
    pb[i] = reinterpret_cast<at::BFloat16*>((reinterpret_cast<uintptr_t>(pbs[i].data()) + 63) & ~uintptr_t{63});
    for (int64_t j = 0; j < NP * page_stride; ++j) {
      pb[i][j] = at::BFloat16(u(rng) * 0.3f);
      pf[i][j] = static_cast<float>(pb[i][j]);  // the same values: the outputs differ only by the kernels' order
    }
  }
  std::vector<int64_t> rows(NP);
  for (int64_t i = 0; i < NP; ++i) rows[i] = i;
  std::shuffle(rows.begin(), rows.end(), rng);
  std::vector<float> q(H * G * D);
  for (auto& v : q) v = u(rng) * 0.5f;
  std::vector<float> acc(H * G * D), m(H * G), l(H * G), scratch(B::disagg_attn::scratch_floats(D, H * G) + 2048);
  const int64_t scratch_off = argc > 5 ? std::atoi(argv[5]) : 0;  // floats: where the scratch lies against the pages
  // the versions (old, new, and an optional third: -DALT=...) x the page dtypes, alternated in every round
#if defined(ALT)
  const int NV = 3;
#else
  const int NV = 2;
#endif
  const int NC = 2 * NV;
  std::vector<std::vector<float>> out(NC, std::vector<float>(H * G * D));
  std::vector<std::vector<double>> times(NC);
  const char* names[6] = {"old fp32", "old bf16", "new fp32", "new bf16", "alt fp32", "alt bf16"};
  auto run = [&](int c, int64_t layer, int64_t s) {
    const int64_t* r = rows.data() + s * pages_per_seq;
    const float* f = pf[hot ? 0 : layer];
    const at::BFloat16* b = pb[hot ? 0 : layer];
    float *ac = acc.data(), *mm = m.data(), *ll = l.data(), *sc = scratch.data() + scratch_off;
    switch (c) {
      case 0: A::disagg_attn::attend_range<float, 64>(q.data(), f, H, head_stride, r, 0, T, G, D, P, page_stride, kv_stride, token_stride, ac, mm, ll, sc); break;
      case 1: A::disagg_attn::attend_range<at::BFloat16, 64>(q.data(), b, H, head_stride, r, 0, T, G, D, P, page_stride, kv_stride, token_stride, ac, mm, ll, sc); break;
      case 2: B::disagg_attn::attend_range<float, 64>(q.data(), f, H, head_stride, r, 0, T, G, D, P, page_stride, kv_stride, token_stride, ac, mm, ll, sc); break;
      case 3: B::disagg_attn::attend_range<at::BFloat16, 64>(q.data(), b, H, head_stride, r, 0, T, G, D, P, page_stride, kv_stride, token_stride, ac, mm, ll, sc); break;
#if defined(ALT)
      case 4: C::disagg_attn::attend_range<float, 64>(q.data(), f, H, head_stride, r, 0, T, G, D, P, page_stride, kv_stride, token_stride, ac, mm, ll, sc); break;
      case 5: C::disagg_attn::attend_range<at::BFloat16, 64>(q.data(), b, H, head_stride, r, 0, T, G, D, P, page_stride, kv_stride, token_stride, ac, mm, ll, sc); break;
#endif
      default: break;
    }
  };
  std::vector<int> order(NC);
  for (int c = 0; c < NC; ++c) order[c] = c;
  std::vector<double> tm(NC);
  for (int round = 0; round < rounds; ++round) {
    std::shuffle(order.begin(), order.end(), rng);  // each round in another order: no version always runs after another
    for (int c : order) {
      const double t = now();
      for (int64_t layer = 0; layer < L; ++layer)
        for (int64_t s = 0; s < S; ++s) {
          std::fill(acc.begin(), acc.end(), 0.f);
          std::fill(m.begin(), m.end(), -INFINITY);
          std::fill(l.begin(), l.end(), 0.f);
          run(c, layer, s);
        }
      tm[c] = now() - t;
      for (int64_t i = 0; i < H * G * D; ++i) out[c][i] = acc[i] / l[i / D];
    }
    for (int c = 0; c < NC; ++c) times[c].push_back(tm[c]);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("attention %s T=%ld S=%ld, 30 layers, %d rounds (median ms; ratios: medians of the rounds' paired ratios):\n",
              hot ? "hot" : "DRAM", static_cast<long>(T), static_cast<long>(S), rounds);
  for (int c = 0; c < NC; ++c) {
    double md = 0;
    for (int64_t i = 0; i < H * G * D; ++i) md = std::max(md, static_cast<double>(std::fabs(out[0][i] - out[c][i])));
    std::vector<double> r0, rd;
    for (int i = 0; i < rounds; ++i) {
      r0.push_back(times[0][i] / times[c][i]);
      rd.push_back(times[c % 2][i] / times[c][i]);
    }
    std::printf("  %s pages: %7.2f ms  old fp32 / this %.3fx  old same dtype / this %.3fx  maxdiff vs old fp32 %.2e\n",
                names[c], median(times[c]) * 1e3, median(r0), median(rd), md);
  }
}
