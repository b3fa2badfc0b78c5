// Causal prefill attention over paged K / V (CPU, AVX-512 or AVX2 + FMA): a chunk of L query tokens at
// positions first .. first + L - 1 of one sequence, each attending to the sequence's keys 0 .. its own
// position. Shared by prefill_attention.cpp (the Python-facing kernel) and tests/csrc/prefill_capi.cpp
// (the same code built for each instruction-set level).
//
// PyTorch's CPU flash SDPA runs these at ~19 GMAC/s of useful work on a Zen 4 core (it computes the masked
// half too); here, per KV head, the keys are converted once to fp32 and transposed in blocks of N (a
// vector's lanes: 16 with AVX-512, 8 with AVX2), so a block's N scores of a query row are the N lanes of
// one accumulator (no horizontal sums), and the values to fp32 rows; then jobs of (KV head, 16 query
// positions) (their G query heads each, RB rows at a time sharing every key and value load) walk the key
// blocks up to the diagonal only, with an online softmax in fp32. D must be a multiple of 16 (<= 256).
//
// The kernel's parallel loops go through `par(begin, end, grain, fn(b, e))` (at::parallel_for in the
// extension, a plain loop in the test shim), so this header needs no ATen.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"

namespace disagg_prefill {

#if defined(__AVX512F__)
constexpr bool SUPPORTED = true;
// 16 lanes; RB = 4 rows x D / 16 value accumulators fit the 32 registers at D = 64
struct Lanes {
  using F = __m512;
  using M = __mmask16;
  static constexpr int64_t N = 16;
  static constexpr int RB = 4;
  static constexpr int CHAINS = 2;
  static constexpr int PR = 4, VC = 4;  // the value tile: PR rows x VC vectors
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
  static F exp(F v) { return disagg_attn::exp512(v); }
  // lanes t with base + t <= lim
  static M upto(int64_t base, int64_t lim) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i keys = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(base)));
    return _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(lim)));
  }
  static F or_ninf(M ok, F v) { return _mm512_mask_blend_ps(ok, set1(-std::numeric_limits<float>::infinity()), v); }
  static F or_zero(M ok, F v) { return _mm512_maskz_mov_ps(ok, v); }
};
#elif defined(DISAGG_ATTN_AVX2)
constexpr bool SUPPORTED = true;
// 8 lanes; 16 registers: RB = 2 rows (D = 64: 16 value accumulators, kept in L1 between uses)
struct Lanes {
  using F = __m256;
  using M = __m256;  // all-ones lanes where true
  static constexpr int64_t N = 8;
  static constexpr int RB = 6;
  static constexpr int CHAINS = 1;
  static constexpr int PR = 1, VC = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static float reduce_max(F v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static float reduce_add(F v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static F exp(F v) { return disagg_attn::exp256(v); }
  static M upto(int64_t base, int64_t lim) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keys = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(base)));
    // keys <= lim  <=>  not (keys > lim)
    const __m256i gt = _mm256_cmpgt_epi32(keys, _mm256_set1_epi32(static_cast<int32_t>(lim)));
    return _mm256_castsi256_ps(_mm256_xor_si256(gt, _mm256_set1_epi32(-1)));
  }
  static F or_ninf(M ok, F v) { return _mm256_blendv_ps(set1(-std::numeric_limits<float>::infinity()), v, ok); }
  static F or_zero(M ok, F v) { return _mm256_and_ps(ok, v); }
};
#else
constexpr bool SUPPORTED = false;
#endif

#if defined(__AVX512F__) || defined(DISAGG_ATTN_AVX2)
constexpr int64_t KB = 16;  // keys per block: one score vector a row (AVX-512), two (AVX2)
constexpr int64_t QB = 16;        // query positions per job
constexpr int64_t DMAX = 256;

template <typename T>
inline float at_f(const T* p) {
  return static_cast<float>(*p);
}

// K of head h, keys [0, S), as fp32 blocks [S / KB][D][KB] (the last block padded with zeros), and V as
// fp32 rows [S][D]; key blocks [b0, b1) only.
template <typename T>
void convert_head(const T* pool, const int64_t* table, int64_t h, int64_t S, int64_t D, int64_t P,
                  int64_t page_stride, int64_t head_stride, int64_t kv_stride, int64_t token_stride, float* kt,
                  float* vf, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    float* blk = kt + b * D * KB;
    for (int64_t t = 0; t < KB; ++t) {
      const int64_t key = b * KB + t;
      if (key >= S) {
        for (int64_t d = 0; d < D; ++d) blk[d * KB + t] = 0.0f;
        continue;
      }
      const T* k = pool + table[key / P] * page_stride + h * head_stride + (key % P) * token_stride;
      float* v = vf + key * D;
      for (int64_t d = 0; d < D; ++d) {
        blk[d * KB + t] = at_f(k + d);
        v[d] = at_f(k + kv_stride + d);
      }
    }
  }
}

// acc[r * lda + v0 .. v0 + VC) += sum over the block's n keys t of p[r][t] * V[t] (vectors v0 .. v0 + VC), for
// PR rows: PR x VC accumulators in registers, each value load shared by the PR rows.
template <int PR, int VC>
inline void pv_tile(const float (*p)[KB], const float* vb, int64_t n, int64_t D, int64_t v0, typename Lanes::F* acc,
                    int64_t lda) {
  using L = Lanes;
  typename L::F a[PR][VC];
  for (int r = 0; r < PR; ++r)
    for (int v = 0; v < VC; ++v) a[r][v] = acc[r * lda + v0 + v];
  for (int64_t t = 0; t < n; ++t) {
    typename L::F pt[PR];
    for (int r = 0; r < PR; ++r) pt[r] = L::set1(p[r][t]);
    for (int v = 0; v < VC; ++v) {
      const typename L::F vv = L::load(vb + t * D + (v0 + v) * L::N);
      for (int r = 0; r < PR; ++r) a[r][v] = L::fmadd(pt[r], vv, a[r][v]);
    }
  }
  for (int r = 0; r < PR; ++r)
    for (int v = 0; v < VC; ++v) acc[r * lda + v0 + v] = a[r][v];
}

// R query rows (fp32, scaled) at causal limits lim[r] (the last key each may see) over key blocks up to
// the largest limit; out rows in fp32. A block's KB scores of a row are W vectors; NV = D / N value
// vectors a row (0: read from D, slower).
template <int R, int NV>
void rows_job(const float* const* qr, const int64_t* lim, const float* kt, const float* vf, int64_t D, float* const* out) {
  using L = Lanes;
  using F = typename L::F;
  constexpr int64_t N = L::N, W = KB / N;
  constexpr int64_t NA = NV > 0 ? NV : DMAX / N;
  const int64_t nv = NV > 0 ? NV : D / N;
  F acc[R][NA];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    for (int64_t v = 0; v < nv; ++v) acc[r][v] = L::zero();
  }
  int64_t last = 0;
  for (int r = 0; r < R; ++r) last = std::max(last, lim[r]);
  alignas(64) float p[R][KB];
  for (int64_t b = 0; b * KB <= last; ++b) {
    const float* blk = kt + b * D * KB;
    F s0[R][W], s1[R][W];  // AVX-512: even and odd d, two chains a row to hide the FMA latency
    for (int r = 0; r < R; ++r)
      for (int64_t w = 0; w < W; ++w) s0[r][w] = s1[r][w] = L::zero();
    if constexpr (L::CHAINS == 2) {
      for (int64_t d = 0; d < D; d += 2) {
        F k0[W], k1[W];
        for (int64_t w = 0; w < W; ++w) {
          k0[w] = L::load(blk + d * KB + w * N);
          k1[w] = L::load(blk + (d + 1) * KB + w * N);
        }
        for (int r = 0; r < R; ++r) {
          const F q0 = L::set1(qr[r][d]), q1 = L::set1(qr[r][d + 1]);
          for (int64_t w = 0; w < W; ++w) {
            s0[r][w] = L::fmadd(q0, k0[w], s0[r][w]);
            s1[r][w] = L::fmadd(q1, k1[w], s1[r][w]);
          }
        }
      }
    } else {  // AVX2: R x W accumulators are chains enough (a GEMM micro-kernel: W loads, R broadcasts)
      for (int64_t d = 0; d < D; ++d) {
        F k0[W];
        for (int64_t w = 0; w < W; ++w) k0[w] = L::load(blk + d * KB + w * N);
        for (int r = 0; r < R; ++r) {
          const F q0 = L::set1(qr[r][d]);
          for (int64_t w = 0; w < W; ++w) s0[r][w] = L::fmadd(q0, k0[w], s0[r][w]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {  // keys past the row's limit are -inf; the online softmax's update
      typename L::M ok[W];
      F sv[W];
      float top = m[r];
      for (int64_t w = 0; w < W; ++w) {
        ok[w] = L::upto(b * KB + w * N, lim[r]);
        sv[w] = L::or_ninf(ok[w], L::add(s0[r][w], s1[r][w]));
        top = std::max(top, L::reduce_max(sv[w]));
      }
      const float c = std::exp(m[r] - top);
      float sum = 0.0f;
      for (int64_t w = 0; w < W; ++w) {
        const F e = L::or_zero(ok[w], L::exp(L::sub(sv[w], L::set1(top))));
        sum += L::reduce_add(e);
        L::store(p[r] + w * N, e);
      }
      l[r] = l[r] * c + sum;
      m[r] = top;
      const F cv = L::set1(c);
      for (int64_t v = 0; v < nv; ++v) acc[r][v] = L::mul(acc[r][v], cv);
    }
    const int64_t n = std::min<int64_t>(KB, last + 1 - b * KB);
    const float* vb = vf + b * KB * D;
    constexpr int PR = R % L::PR == 0 ? L::PR : 1;
    for (int r0 = 0; r0 < R; r0 += PR) {
      if (nv % L::VC == 0) {
        for (int64_t v0 = 0; v0 < nv; v0 += L::VC) pv_tile<PR, L::VC>(p + r0, vb, n, D, v0, &acc[r0][0], NA);
      } else {
        for (int64_t v0 = 0; v0 < nv; ++v0) pv_tile<PR, 1>(p + r0, vb, n, D, v0, &acc[r0][0], NA);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const F inv = L::set1(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    for (int64_t v = 0; v < nv; ++v) L::store(out[r] + v * N, L::mul(acc[r][v], inv));
  }
}

template <int NV>
void all_rows(int64_t rows, const float* const* qr, const int64_t* lim, const float* kt, const float* vf, int64_t D,
              float* const* out) {
  constexpr int RB = Lanes::RB;
  int64_t r = 0;
  for (; r + RB <= rows; r += RB) rows_job<RB, NV>(qr + r, lim + r, kt, vf, D, out + r);
  for (; r < rows; ++r) rows_job<1, NV>(qr + r, lim + r, kt, vf, D, out + r);
}

// Every job of a chunk, (KV head h, the QB query positions from i0: its G query heads' rows r = i * G + g), in the
// order 0, last, 1, last - 1, ... (a causal block's cost grows with its position, so any contiguous share of the
// jobs, at::parallel_for's split, holds as much work as another): fn(h, i0, n, lim, of) computes the job's n * G
// rows (row r's last visible key lim[r]) into of (fp32 rows of D), which then go to out (in T).
template <typename T, typename Par, typename Fn>
void run_jobs(T* out, int64_t L, int64_t first, int64_t Hq, int64_t Hkv, int64_t D, const Par& par, const Fn& fn) {
  const int64_t G = Hq / Hkv, qblocks = (L + QB - 1) / QB;
  par(0, Hkv * qblocks, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> of(QB * G * D);
    std::vector<int64_t> lim(QB * G);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t h = j % Hkv, k = j / Hkv, qb = k % 2 == 0 ? k / 2 : qblocks - 1 - k / 2;
      const int64_t i0 = qb * QB, n = std::min(QB, L - i0);
      for (int64_t r = 0; r < n * G; ++r) lim[r] = first + i0 + r / G;
      fn(h, i0, n, lim.data(), of.data());
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) {
          T* dst = out + ((i0 + i) * Hq + h * G + g) * D;
          const float* o = of.data() + (i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d]);
        }
    }
  });
}

#if defined(__AVX512BF16__)
// bf16 pages on AVX-512 BF16: the products of both matmuls by vdpbf16ps (two bf16 products a lane, summed in fp32),
// half the instructions of the fp32 path. K of head h as blocks [S / KB][D / 2][KB] of d-pairs (lane t: key t's
// (d, d + 1)), V as blocks [S / KB][KB / 2][D] of key pairs (lane d: (V[2t'][d], V[2t' + 1][d])); the bf16 pages'
// values as they are (no rounding). The query's bf16 pairs are broadcast as they are; the probabilities are rounded
// to bf16 before their products with V, as PyTorch's CPU flash attention rounds them for bf16 inputs (the scores,
// the softmax and the sums stay fp32). SmolLM2, one thread, AVX-512 Zen 4: see BENCHMARKS.md.
inline void convert_head_bf16(const at::BFloat16* pool, const int64_t* table, int64_t h, int64_t S, int64_t D,
                              int64_t P, int64_t page_stride, int64_t head_stride, int64_t kv_stride,
                              int64_t token_stride, uint32_t* kt, uint16_t* vt, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    uint32_t* kb = kt + b * (D / 2) * KB;
    uint16_t* vb = vt + b * KB * D;  // [KB / 2][D][2] halves
    for (int64_t t = 0; t < KB; ++t) {
      const int64_t key = b * KB + t;
      uint16_t* vrow = vb + (t / 2) * D * 2 + (t % 2);
      if (key >= S) {
        for (int64_t p = 0; p < D / 2; ++p) kb[p * KB + t] = 0;
        for (int64_t d = 0; d < D; ++d) vrow[d * 2] = 0;
        continue;
      }
      const int64_t at = table[key / P] * page_stride + h * head_stride + (key % P) * token_stride;
      const uint16_t* k = reinterpret_cast<const uint16_t*>(pool + at);
      for (int64_t p = 0; p < D / 2; ++p)
        kb[p * KB + t] = static_cast<uint32_t>(k[2 * p]) | (static_cast<uint32_t>(k[2 * p + 1]) << 16);
      for (int64_t d = 0; d < D; ++d) vrow[d * 2] = k[kv_stride + d];
    }
  }
}

// rows_job() on the bf16 layouts: R query rows (bf16, unscaled; their scores times `scale`), NV = D / 16.
template <int R, int NV>
void rows_job_bf16(const uint16_t* const* qr, const int64_t* lim, const uint32_t* kt, const uint32_t* vt, int64_t D,
                   float scale, float* const* out) {
  constexpr int64_t NA = NV > 0 ? NV : DMAX / 16;
  const int64_t nv = NV > 0 ? NV : D / 16;
  __m512 acc[R][NA];
  float m[R], l[R];
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    for (int64_t v = 0; v < nv; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  int64_t last = 0;
  for (int r = 0; r < R; ++r) last = std::max(last, lim[r]);
  auto pair = [](const uint16_t* p) {
    uint32_t w;
    std::memcpy(&w, p, sizeof w);
    return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w));
  };
  alignas(64) uint16_t pb[R][KB];  // a block's probabilities of each row, bf16
  const __m512 sv_scale = _mm512_set1_ps(scale);
  for (int64_t b = 0; b * KB <= last; ++b) {
    const uint32_t* kb = kt + b * (D / 2) * KB;
    __m512 s0[R], s1[R];  // even and odd d-pairs: two chains a row
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * KB);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (p + 1) * KB);
      for (int r = 0; r < R; ++r) {
        s0[r] = _mm512_dpbf16_ps(s0[r], k0, pair(qr[r] + 2 * p));
        s1[r] = _mm512_dpbf16_ps(s1[r], k1, pair(qr[r] + 2 * p + 2));
      }
    }
    for (int r = 0; r < R; ++r) {  // keys past the row's limit are -inf; the online softmax's update
      const __mmask16 ok = Lanes::upto(b * KB, lim[r]);
      const __m512 sv = Lanes::or_ninf(ok, _mm512_mul_ps(_mm512_add_ps(s0[r], s1[r]), sv_scale));
      const float top = std::max(m[r], _mm512_reduce_max_ps(sv));
      const float c = std::exp(m[r] - top);
      const __m512 e = _mm512_maskz_mov_ps(ok, disagg_attn::exp512(_mm512_sub_ps(sv, _mm512_set1_ps(top))));
      l[r] = l[r] * c + _mm512_reduce_add_ps(e);
      m[r] = top;
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r]), (__m256i)_mm512_cvtneps_pbh(e));
      const __m512 cv = _mm512_set1_ps(c);
      for (int64_t v = 0; v < nv; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], cv);
    }
    const int64_t pairs = (std::min<int64_t>(KB, last + 1 - b * KB) + 1) / 2;
    const uint32_t* vb = vt + b * (KB / 2) * D;
    for (int64_t t = 0; t < pairs; ++t) {
      __m512bh pr[R];
      for (int r = 0; r < R; ++r) pr[r] = pair(pb[r] + 2 * t);
      for (int64_t v = 0; v < nv; ++v) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + t * D + v * 16);
        for (int r = 0; r < R; ++r) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], vv, pr[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(out[r] + v * 16, _mm512_mul_ps(acc[r][v], inv));
  }
}

template <int NV>
void all_rows_bf16(int64_t rows, const uint16_t* const* qr, const int64_t* lim, const uint32_t* kt, const uint32_t* vt,
                   int64_t D, float scale, float* const* out) {
  constexpr int RB = Lanes::RB;
  int64_t r = 0;
  for (; r + RB <= rows; r += RB) rows_job_bf16<RB, NV>(qr + r, lim + r, kt, vt, D, scale, out + r);
  for (; r < rows; ++r) rows_job_bf16<1, NV>(qr + r, lim + r, kt, vt, D, scale, out + r);
}

// prefill_kernel() on bf16 pages and queries with vdpbf16ps.
template <typename Par>
void prefill_kernel_bf16(const at::BFloat16* q, const at::BFloat16* pool, const int64_t* table, at::BFloat16* out,
                         int64_t L, int64_t first, int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t page_stride,
                         int64_t head_stride, int64_t kv_stride, int64_t token_stride, float scale, const Par& par) {
  const int64_t G = Hq / Hkv, S = first + L, nb = (S + KB - 1) / KB;
  std::vector<uint32_t> kt(Hkv * nb * (D / 2) * KB), vt(Hkv * nb * (KB / 2) * D);
  par(0, Hkv * nb, 4, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t h = j / nb, b = j % nb;
      uint16_t* vh = reinterpret_cast<uint16_t*>(vt.data() + h * nb * (KB / 2) * D);
      convert_head_bf16(pool, table, h, S, D, P, page_stride, head_stride, kv_stride, token_stride,
                        kt.data() + h * nb * (D / 2) * KB, vh, b, b + 1);
    }
  });
  run_jobs(out, L, first, Hq, Hkv, D, par, [&](int64_t h, int64_t i0, int64_t n, const int64_t* lim, float* of) {
    std::vector<const uint16_t*> qr(n * G);
    std::vector<float*> orow(n * G);
    for (int64_t r = 0; r < n * G; ++r) {
      qr[r] = reinterpret_cast<const uint16_t*>(q + ((i0 + r / G) * Hq + h * G + r % G) * D);
      orow[r] = of + r * D;
    }
    const auto rows = D == 64 ? all_rows_bf16<4> : D == 128 ? all_rows_bf16<8> : all_rows_bf16<0>;
    rows(n * G, qr.data(), lim, kt.data() + h * nb * (D / 2) * KB, vt.data() + h * nb * (KB / 2) * D, D, scale,
         orow.data());
  });
}
#endif

// The whole chunk: q [L, Hq, D] and out [L, Hq, D] in T (fp32 or bf16), the pool's pages (PT: fp32 or bf16) as
// paged_decode_attention takes them, table the sequence's pages in token order.
template <typename T, typename PT, typename Par>
void prefill_kernel(const T* q, const PT* pool, const int64_t* table, T* out, int64_t L, int64_t first, int64_t Hq,
                    int64_t Hkv, int64_t D, int64_t P, int64_t page_stride, int64_t head_stride, int64_t kv_stride,
                    int64_t token_stride, float scale, const Par& par) {
#if defined(__AVX512BF16__)
  // vdpbf16ps where it runs one a cycle (AMD); on Intel's cores, where it runs one in two (disagg_cpu::intel_cores),
  // the fp32 kernel below on the same bf16 pages and queries: on the Emerald Rapids Xeon (session 41, SmolLM2's
  // heads, one thread, alternated, two runs) it took 0.79-0.98x the bf16 kernel's time at 128-2,048 tokens.
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<PT, at::BFloat16>)
    if (disagg_attn::scores_by_dpbf16())
      return prefill_kernel_bf16(q, pool, table, out, L, first, Hq, Hkv, D, P, page_stride, head_stride, kv_stride,
                                 token_stride, scale, par);
#endif
  const int64_t G = Hq / Hkv, S = first + L, nb = (S + KB - 1) / KB;
  std::vector<float> kt(Hkv * nb * D * KB), vf(Hkv * nb * KB * D);
  par(0, Hkv * nb, 4, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t h = j / nb, b = j % nb;
      convert_head(pool, table, h, S, D, P, page_stride, head_stride, kv_stride, token_stride,
                   kt.data() + h * nb * D * KB, vf.data() + h * nb * KB * D, b, b + 1);
    }
  });
  run_jobs(out, L, first, Hq, Hkv, D, par, [&](int64_t h, int64_t i0, int64_t n, const int64_t* lim, float* of) {
    std::vector<float> qf(n * G * D);
    std::vector<const float*> qr(n * G);
    std::vector<float*> orow(n * G);
    for (int64_t r = 0; r < n * G; ++r) {
      const T* src = q + ((i0 + r / G) * Hq + h * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] = at_f(src + d) * scale;
      qr[r] = qf.data() + r * D;
      orow[r] = of + r * D;
    }
    constexpr int64_t N = Lanes::N;
    const auto rows = D == 4 * N ? all_rows<4> : D == 8 * N ? all_rows<8> : D == 16 * N ? all_rows<16> : all_rows<0>;
    rows(n * G, qr.data(), lim, kt.data() + h * nb * D * KB, vf.data() + h * nb * KB * D, D, orow.data());
  });
}
#endif

}  // namespace disagg_prefill
