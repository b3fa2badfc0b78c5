// Dense fp32 GEMM over groups of 16 outputs, for the fused decode step (decode_step.cpp) on any CPU:
// y[r, 16 g + i] (+)= sum_k x[r, k] * W[16 g + i, k] (+ bias). W is the model's own fp32 weight, [N, K] row
// major — no packed copy: 4 outputs' rows are read as 4 sequential streams and dotted with up to ROWS input
// rows at once (a register tile: each vector loaded serves several FMAs), then summed across lanes. x: R rows of
// fp32, row stride K; y and bias fp32. AVX-512 F (16 lanes), AVX2 + FMA (8 lanes) or plain loops, by how the
// kernels were built (torch_engine/kernels.py: -march of this CPU). Requires K % 32 == 0 (the fused step's
// block).
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace disagg_f32 {

constexpr int64_t DENSE_F32 = -2;  // the fused step's kind for a dense fp32 weight (bf16: -1, integer: >= 0)

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t LANES = 16;
constexpr int64_t ROWS = 4;  // input rows per pass over a group's weights: 4 x 4 accumulators + 8 loads
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t LANES = 8;
constexpr int64_t ROWS = 2;  // 16 ymm registers: 2 x 4 accumulators, 4 weight and 2 input vectors
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#else
constexpr int64_t ROWS = 4;
#endif
constexpr int OUTS = 4;  // weight rows (outputs) dotted at once: each input vector loaded serves 4 FMAs

// The R x OUTS dot products of weight rows w[0..OUTS) (K values, rows K apart) with input rows x[0..R)
// (stride ldx): out[r][o]. Each accumulator is its own chain (R x OUTS of them hide an FMA's latency). The
// next OUTS rows (w + OUTS K, the same number of lines) are prefetched meanwhile, every line of them: four
// streams of K floats are too short for the hardware prefetcher to ramp up (without it the batch-1 step read
// its weights at half the read bandwidth).
template <int R>
inline void dots(const float* w, int64_t K, const float* x, int64_t ldx, float (&out)[R][OUTS]) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const char* ahead = reinterpret_cast<const char*>(w + OUTS * K);
  Vec acc[R][OUTS];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < OUTS; ++o) acc[r][o] = vzero();
  constexpr int64_t LINES = OUTS * LANES * 4 / 64;  // of the next rows, per step of LANES values
  for (int64_t k = 0; k < K; k += LANES) {
    for (int64_t c = 0; c < LINES; ++c) __builtin_prefetch(ahead + (k / LANES * LINES + c) * 64, 0, 3);
    Vec wv[OUTS];
    for (int o = 0; o < OUTS; ++o) wv[o] = vload(w + o * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * ldx + k);
      for (int o = 0; o < OUTS; ++o) acc[r][o] = vfma(xv, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < OUTS; ++o) out[r][o] = vsum(acc[r][o]);
#else
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < OUTS; ++o) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[r * ldx + k] * w[o * K + k];
      out[r][o] = s;
    }
#endif
}

template <int R>
inline void group_rows(const float* wg, int64_t K, const float* x, const float* bias, float* y, int64_t ldy,
                       int64_t n0, bool accumulate) {
  float d[R][OUTS];
  for (int64_t i = 0; i < 16; i += OUTS) {
    dots<R>(wg + i * K, K, x, K, d);
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < OUTS; ++o) {
        const float v = d[r][o] + (bias != nullptr ? bias[n0 + i + o] : 0.0f);
        float* out = y + r * ldy + n0 + i + o;
        *out = accumulate ? *out + v : v;
      }
  }
}

using RowsFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, bool);
constexpr RowsFn ROWS_FN[] = {group_rows<1>, group_rows<2>, group_rows<3>, group_rows<4>};  // up to ROWS used

// Groups [g0, g1) of 16 outputs of W ([N, K]) for R rows of x; y's rows ldy apart.
inline void gemm_groups(const float* w, int64_t K, const float* x, int64_t R, int64_t g0, int64_t g1, float* y,
                        int64_t ldy, const float* bias, bool accumulate) {
  for (int64_t g = g0; g < g1; ++g) {
    const float* wg = w + g * 16 * K;
    for (int64_t r0 = 0; r0 < R; r0 += ROWS) {
      const int64_t n = std::min(ROWS, R - r0);
      ROWS_FN[n - 1](wg, K, x + r0 * K, bias, y + r0 * ldy, ldy, g * 16, accumulate);
    }
  }
}

}  // namespace disagg_f32
