// Dense bf16 GEMM over groups of 16 outputs, for the fused decode step (decode_step.cpp) on CPUs with
// AVX-512 BF16: y[r, 16 g + i] (+)= sum_k x[r, k] * W[16 g + i, k] (+ bias), W packed as gemm_bf16.cpp packs
// it ([N / 16, K / 2, 16, 2]: each pair of k values of a group's 16 outputs is one 64-byte line, so one
// vdpbf16ps with a broadcast pair of an input row accumulates 16 outputs and no horizontal sum is needed).
// x: R rows of bf16, row stride K; y and bias fp32. Rows go 8 at a time over a group's weights (which then
// stay in cache); up to 4 accumulators per row hide vdpbf16ps's latency at 1-2 rows.
#pragma once

#include <torch/extension.h>

#include <algorithm>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define DISAGG_HAS_BF16_GEMM 1
#endif

namespace disagg_bf16 {

constexpr int64_t DENSE = -1;  // the fused step's kind for a dense bf16 weight (the integer kinds are >= 0)
constexpr int64_t ROWS = 8;    // rows per pass over a group's weights

inline bool supported() {
#if defined(DISAGG_HAS_BF16_GEMM)
  return true;
#else
  return false;
#endif
}

#if defined(DISAGG_HAS_BF16_GEMM)
// out[r] = the 16 outputs of one packed group (wb) for input row r of x (R rows, row stride K); U
// accumulators per row hide vdpbf16ps's latency at few rows. Shared with gemm_bf16.cpp.
template <int R, int U>
inline void dot16(const at::BFloat16* x, int64_t K, const at::BFloat16* wb, __m512 (&out)[R]) {
  __m512 acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  const int64_t KP = K / 2;
  const int32_t* xi = reinterpret_cast<const int32_t*>(x);  // pairs of bf16 of the input rows
  int64_t kp = 0;
  for (; kp + U <= KP; kp += U) {
    for (int u = 0; u < U; ++u) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wb + (kp + u) * 32));
      for (int r = 0; r < R; ++r)
        acc[u][r] = _mm512_dpbf16_ps(acc[u][r], (__m512bh)_mm512_set1_epi32(xi[r * KP + kp + u]), wv);
    }
  }
  for (; kp < KP; ++kp) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wb + kp * 32));
    for (int r = 0; r < R; ++r)
      acc[0][r] = _mm512_dpbf16_ps(acc[0][r], (__m512bh)_mm512_set1_epi32(xi[r * KP + kp]), wv);
  }
  for (int r = 0; r < R; ++r) {
    out[r] = acc[0][r];
    for (int u = 1; u < U; ++u) out[r] = _mm512_add_ps(out[r], acc[u][r]);
  }
}

template <int R, int U>
inline void tile(const at::BFloat16* x, int64_t K, const at::BFloat16* wb, const float* bias, float* y, int64_t ldy,
                 int64_t n0, bool accumulate) {
  __m512 s[R];
  dot16<R, U>(x, K, wb, s);
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    float* o = y + r * ldy + n0;
    __m512 v = _mm512_add_ps(s[r], b);
    if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(o));
    _mm512_storeu_ps(o, v);
  }
}

template <int R>
inline void rows(const at::BFloat16* x, int64_t K, const at::BFloat16* wb, const float* bias, float* y, int64_t ldy,
                 int64_t n0, bool accumulate) {
  constexpr int U = R == 1 ? 4 : (R == 2 ? 2 : 1);
  tile<R, U>(x, K, wb, bias, y, ldy, n0, accumulate);
}

using RowsFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, const float*, float*, int64_t, int64_t,
                        bool);
constexpr RowsFn ROWS_FN[] = {rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};
#endif

// Groups [g0, g1) of 16 outputs of W (packed, K inputs) for R rows of x; y's rows ldy apart.
inline void gemm_groups(const at::BFloat16* w, int64_t K, const at::BFloat16* x, int64_t R, int64_t g0, int64_t g1,
                        float* y, int64_t ldy, const float* bias, bool accumulate) {
#if defined(DISAGG_HAS_BF16_GEMM)
  for (int64_t g = g0; g < g1; ++g) {
    const at::BFloat16* wb = w + g * K * 16;
    for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
      const int64_t n = std::min(ROWS, R - r0);
      ROWS_FN[n - 1](x + r0 * K, K, wb, bias, y + r0 * ldy, ldy, g * 16, accumulate);
    }
  }
#else
  (void)w, (void)K, (void)x, (void)R, (void)g0, (void)g1, (void)y, (void)ldy, (void)bias, (void)accumulate;
#endif
}

}  // namespace disagg_bf16
