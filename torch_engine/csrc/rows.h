// Row-wise pieces of a layer in fp32, shared by decode_step.cpp (the compiled decode step) and row_ops.cpp (the
// same pieces for the eager model's prefill rows): SiLU(gate) * up, and HF's rotary embedding of one head.
#pragma once

#include <cmath>
#include <cstdint>

#include <c10/util/BFloat16.h>

#include "attention.h"

namespace disagg_rows {

// n bf16 values -> fp32 (exact).
inline void to_float(const at::BFloat16* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, disagg_attn::load16(x + i));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

// n fp32 values -> bf16, rounded to nearest even as at::BFloat16 rounds (the values are finite).
inline void to_bf16(const float* x, at::BFloat16* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(x + i));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
#endif
  for (; i < n; ++i) out[i] = at::BFloat16(x[i]);
}

// out[i] = SiLU(gate[i]) * up[i] for i < n.
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = disagg_attn::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)),
                                            _mm512_loadu_ps(up + i)));
  }
#elif defined(DISAGG_ATTN_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = disagg_attn::exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                            _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// HF's rotate_half on one head of D values: pairs i and i + D/2.
inline void rope(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

}  // namespace disagg_rows
