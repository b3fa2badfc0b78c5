// Paged decode attention: the G query heads of one KV head (one query token each) over a range of a
// sequence's tokens, K / V read in place from the pages, online softmax in fp32. Shared by
// paged_attention.cpp (the Python-facing kernel) and decode_step.cpp (the fused decode step).
//
// attend_range() covers tokens [t0, t1) of every KV head and leaves the unnormalised state (acc, running
// max m, sum l), so a long sequence can be split over threads and the parts combined by merge();
// decode_job() is the whole sequence at once. Tokens go in chunks of up to 16 (across page boundaries). With AVX-512 and a
// head size that is a multiple of 16, a chunk's 16 scores of a query head come out of 16 dot-product
// accumulators reduced together by one transpose-and-add tree (no reduction per token), the softmax's
// exponentials are vectorised, and the value accumulators stay in registers; elsewhere plain loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <c10/util/BFloat16.h>

#include "cpu_vendor.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// AVX2 + FMA without AVX-512 (an AVX2-only CPU: its engine runs fp32): the chunk kernel and exp in 8 lanes
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define DISAGG_ATTN_AVX2 1
#endif

namespace disagg_attn {

constexpr int64_t CHUNK = 16;

#if defined(__AVX512F__)
constexpr bool AVX512 = true;
#else
constexpr bool AVX512 = false;
#endif

// Whether the bf16 pages' scores take vdpbf16ps (the query as bf16 hi + lo parts: AMD) or the K words widened to
// fp32 and two FMAs (Intel; the query as it is, in fp32). On the Emerald Rapids, alternated in one process with the K /
// V in cache: the FMAs 1.15-1.17x faster, the chunk's K widened once for its G query heads another 1.10x.
inline bool scores_by_dpbf16() {
#if defined(__AVX512BF16__)
  return !disagg_cpu::intel_cores();
#else
  return false;
#endif
}

// bf16 pages without converting them: a 64-byte load holds 32 values as 16 pairs; as fp32 the pair's
// second value is the word with its low half cleared and the first is the word shifted left by 16. So the
// head's D values are handled as D / 32 blocks of (16 even-indexed, 16 odd-indexed) values: the query and
// the value accumulators are kept in that split order (split() / unsplit()), the dot products and the
// weighted sums do not care about the order.
inline void split(const float* x, float* out, int64_t D) {
  for (int64_t v = 0; v < D / 32; ++v)
    for (int64_t i = 0; i < 16; ++i) {
      out[v * 32 + i] = x[v * 32 + 2 * i];
      out[v * 32 + 16 + i] = x[v * 32 + 2 * i + 1];
    }
}

inline void unsplit(const float* x, float* out, int64_t D) {
  for (int64_t v = 0; v < D / 32; ++v)
    for (int64_t i = 0; i < 16; ++i) {
      out[v * 32 + 2 * i] = x[v * 32 + i];
      out[v * 32 + 2 * i + 1] = x[v * 32 + 16 + i];
    }
}

// Floats of scratch attend_range() (and attend_split()) needs for head size D and Q = H * G query heads.
inline int64_t scratch_floats(int64_t D, int64_t Q) { return 3 * CHUNK * D + 2 * CHUNK + 3 * Q * D + 17 * Q; }

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// The cache lines of the next chunk's K / V of one KV head, prefetched a few at a time from inside the chunk kernels'
// loops (chunk_avx2, chunk_avx512, chunk_bf16_avx512), spread over their compute: every build on every CPU. On the
// AVX2-only Zen 3 (family 25 model 1) touch_range's window of loads and the chunks' compute ran one after the other (SmolLM2's
// 30 layers at 16 x 290 tokens, fp32 pages, 214 MB: 26-30 ms from DRAM, 14.4 ms in L3), and prefetches in bursts — a
// chunk or a head at a time, 1-8 chunks ahead — were slower still (0.88-0.98x): a burst fills the miss buffers and the
// chunk's own loads wait behind it. A line per 8 FMAs of the scores and two per token of the weighted values: 1.32x
// faster at 290 tokens, 1.38x at 1,000, 1.11x at 37, 0.965x with the K / V in cache (alternated in one process;
// BENCHMARKS.md). On the Emerald Rapids Xeon (family 6 model 207, session 41) the AVX-512 kernels' touch windows had
// the same flaw (its AVX2 build's fp32 attention ran 1.5x faster than its AVX-512 build's): spread there, with the
// three-loop fp32 kernel, 1.13-1.16x at 8-16 x 290 tokens from DRAM (fp32 pages), the bf16 split path 1.08-1.12x.
// The cursor counts token and line instead of dividing a line number by the lines a token (until session 42 two
// 64-bit `idiv`s a line, 128 a chunk and KV head of SmolLM2's bf16 pages: the divider, not the FMAs, set the pace —
// the same Xeon, alternated in one process, bit-identical outputs: the bf16 split path 1.7-2.0x faster with the K / V
// in cache, 1.2-1.4x after a weights-sized stream, at 8 x 290 tokens). AMD's AVX-512 builds touched windows of ~256 KB
// instead (touch_range) until session 43: on a Zen 5 (family 26 model 2, one thread, alternated in one process,
// outputs bit-identical) spreading was 1.38-1.57x faster for the bf16 split path after a weights-sized stream at
// 1-16 x 60-1,000 tokens (0.93x with the K / V in cache), fp32 pages 1.40x from DRAM and 1.23x in cache. A Zen 4 was
// not measured with the cursor (its windows had been measured against prefetches in bursts only).
struct PfCursor {
  const char* const* rows = nullptr;  // the next chunk's K rows of this head (V at + kv_bytes); n = 0: none
  int64_t n = 0, kv_bytes = 0, lines = 0;  // tokens, V's offset in bytes, cache lines a row
  int64_t t = 0, r = 0;                    // the next line: token t's line r (its K's lines, then its V's)
  void step(int64_t k) {
    for (; k > 0 && t < n; --k) {
      __builtin_prefetch(rows[t] + (r < lines ? r * 64 : kv_bytes + (r - lines) * 64), 0, 3);
      if (++r == 2 * lines) {
        r = 0;
        ++t;
      }
    }
  }
  void finish() { step(2 * lines * (n - t)); }
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // the 16 bits become the high half of an fp32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp(x), ~1 ulp: 2^n * p(r) with n = round(x / ln 2), |r| <= ln 2 / 2, p of degree 6.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp(x) of one float by exp512() (inline: the chunk's rescale factor, once a query head and chunk; libm's call
// was ~2 % of a batch-16 step). x = -inf (a head's first chunk) gives exp(-87.3), which scales zeros.
inline float exp1(float x) { return _mm512_cvtss_f32(exp512(_mm512_set1_ps(x))); }

// Lane t of the result = the sum of the 16 lanes of a[t].
inline __m512 hsum16(const __m512 a[16]) {
  __m512 x[8], y[4], w[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// One chunk of len <= 16 tokens (K / V rows as fp32 pointers; rows past len point at zeros) for the G
// query heads, in three loops as chunk_bf16_avx512(): every head's scores (16 independent dot products, one
// accumulator register per token), then every head's online-softmax update (its chain of reductions and
// exponentials overlaps across heads), then the weighted values, each V vector loaded once for a block of GB
// heads whose accumulators stay in registers. pts / cs: G * 16 and G floats of scratch.
template <int64_t DV>
inline void chunk_avx512(const float* qf, const float* const* krow, const float* const* vrow, int64_t len, int64_t G,
                         int64_t dyn_dv, float* acc, float* m, float* l, float* pts, float* cs, PfCursor& pf) {
  const int64_t nv = DV > 0 ? DV : dyn_dv;
  const __mmask16 valid = static_cast<__mmask16>((1u << len) - 1u);
  for (int64_t g = 0; g < G; ++g) {  // scores
    const float* qg = qf + g * nv * 16;
    __m512 a[16];
    {
      const __m512 q0 = _mm512_loadu_ps(qg);
      for (int t = 0; t < 16; ++t) a[t] = _mm512_mul_ps(q0, _mm512_loadu_ps(krow[t]));
    }
    for (int64_t v = 1; v < nv; ++v) {
      const __m512 qv = _mm512_loadu_ps(qg + v * 16);
      for (int t = 0; t < 16; ++t) a[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krow[t] + v * 16), a[t]);
      pf.step(2);
    }
    _mm512_storeu_ps(pts + g * 16, hsum16(a));
  }
  for (int64_t g = 0; g < G; ++g) {  // the online softmax's update
    const __m512 s =
        _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _mm512_loadu_ps(pts + g * 16));
    const float mp = std::max(m[g], _mm512_reduce_max_ps(s));
    cs[g] = exp1(m[g] - mp);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mp))));
    l[g] = l[g] * cs[g] + _mm512_reduce_add_ps(p);
    m[g] = mp;
    _mm512_storeu_ps(pts + g * 16, p);
  }
  // the weighted values: GB heads x NW vectors of accumulators (8-16 chains of FMAs)
  constexpr int64_t NW = DV == 0 ? 1 : std::min<int64_t>(DV, 8);
  constexpr int64_t GB = DV == 0 ? 1 : std::max<int64_t>(1, std::min<int64_t>(4, 12 / NW));
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t gn = std::min<int64_t>(GB, G - g0);
    for (int64_t v0 = 0; v0 < nv; v0 += NW) {  // DV == 0 (a head size without its own build): a vector at a time
      __m512 av[GB][NW];
      for (int64_t gi = 0; gi < GB; ++gi)
        if (gi < gn) {
          const __m512 cv = _mm512_set1_ps(cs[g0 + gi]);
          for (int64_t w = 0; w < NW; ++w)
            av[gi][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g0 + gi) * nv * 16 + (v0 + w) * 16), cv);
        }
      for (int64_t t = 0; t < len; ++t) {
        __m512 vv[NW];
        for (int64_t w = 0; w < NW; ++w) vv[w] = _mm512_loadu_ps(vrow[t] + (v0 + w) * 16);
        for (int64_t gi = 0; gi < GB; ++gi)
          if (gi < gn) {
            const __m512 pv = _mm512_set1_ps(pts[(g0 + gi) * 16 + t]);
            for (int64_t w = 0; w < NW; ++w) av[gi][w] = _mm512_fmadd_ps(pv, vv[w], av[gi][w]);
          }
        pf.step((gn * NW + 3) / 4);
      }
      for (int64_t gi = 0; gi < GB; ++gi)
        if (gi < gn)
          for (int64_t w = 0; w < NW; ++w) _mm512_storeu_ps(acc + (g0 + gi) * nv * 16 + (v0 + w) * 16, av[gi][w]);
    }
  }
}

// DPBF16 (scores_by_dpbf16()): qhl holds each query head as bf16 hi and lo parts (q ~= hi + lo to 16 bits), natural
// order, and its scores are vdpbf16ps of the K words with hi and with lo, no conversion of K at all; else qs (split
// order) against the K words widened to fp32. pts / cs: G * 16 and G floats of scratch (the chunk's probabilities and
// each head's rescale).
template <int64_t DW, bool DPBF16>
inline void chunk_bf16_avx512(const float* qs, const uint16_t* qhl, const uint16_t* const* krow,
                              const uint16_t* const* vrow, int64_t len, int64_t G, int64_t dyn_dw, float* acc,
                              float* m, float* l, float* pts, float* cs, PfCursor& pf) {
  static_cast<void>(qhl);  // (the FMA path takes qs)
  const int64_t nw = DW > 0 ? DW : dyn_dw;
  const __mmask16 valid = static_cast<__mmask16>((1u << len) - 1u);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  auto even = [](__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); };
  auto odd = [&](__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, high)); };
  // the FMA path with a head size of its own build: the chunk's K widened to fp32 once for the G query heads
  constexpr bool widen = !DPBF16 && DW > 0;
  alignas(64) float kf[widen ? 16 * DW * 32 : 1];
  if constexpr (widen)
    for (int t = 0; t < 16; ++t)
      for (int64_t w = 0; w < DW; ++w) {
        const __m512i kw = _mm512_loadu_si512(krow[t] + w * 32);
        _mm512_store_ps(kf + (t * DW + w) * 32, even(kw));
        _mm512_store_ps(kf + (t * DW + w) * 32 + 16, odd(kw));
      }
  for (int64_t g = 0; g < G; ++g) {  // scores
    __m512 a[16];
    for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if constexpr (DPBF16) {
      const uint16_t* qg = qhl + g * nw * 64;
      for (int64_t w = 0; w < nw; ++w) {
        const __m512bh qh = (__m512bh)_mm512_loadu_si512(qg + w * 32);
        const __m512bh ql = (__m512bh)_mm512_loadu_si512(qg + nw * 32 + w * 32);
        for (int t = 0; t < 16; ++t) {
          const __m512bh kw = (__m512bh)_mm512_loadu_si512(krow[t] + w * 32);
          a[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[t], kw, qh), kw, ql);
        }
        pf.step(4);
      }
    } else
#endif
    {
      const float* qg = qs + g * nw * 32;
      for (int64_t w = 0; w < nw; ++w) {
        const __m512 qe = _mm512_loadu_ps(qg + w * 32), qo = _mm512_loadu_ps(qg + w * 32 + 16);
        for (int t = 0; t < 16; ++t) {
          if constexpr (widen) {
            const float* kt = kf + (t * DW + w) * 32;
            a[t] = _mm512_fmadd_ps(qo, _mm512_load_ps(kt + 16), _mm512_fmadd_ps(qe, _mm512_load_ps(kt), a[t]));
          } else {
            const __m512i kw = _mm512_loadu_si512(krow[t] + w * 32);
            a[t] = _mm512_fmadd_ps(qo, odd(kw), _mm512_fmadd_ps(qe, even(kw), a[t]));
          }
        }
        pf.step(4);
      }
    }
    _mm512_storeu_ps(pts + g * 16, hsum16(a));
  }
  // the online softmax's update, a loop of its own: its chain of reductions and exponentials (~100 cycles a head)
  // overlaps across heads (the Emerald Rapids, in cache: 1.14-1.15x faster than in the scores' loop; either vendor's
  // path, measured on Intel's only). Altogether there (attention_ab.txt of session 40): 1.33-1.36x at 8 x 290 tokens
  // after a weights-sized stream, 1.34x at 1,000, 1.32x at 37, 1.41-1.43x in cache or for one sequence.
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s =
        _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _mm512_loadu_ps(pts + g * 16));
    const float mp = std::max(m[g], _mm512_reduce_max_ps(s));
    cs[g] = exp1(m[g] - mp);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mp))));
    l[g] = l[g] * cs[g] + _mm512_reduce_add_ps(p);
    m[g] = mp;
    _mm512_storeu_ps(pts + g * 16, p);
  }
  // the weighted values: each V row split once, shared by a block of GB query heads whose accumulators
  // stay in registers
  constexpr int64_t GB = DW == 0 ? 1 : (DW >= 4 ? 2 : 4);
  constexpr int64_t NW = DW == 0 ? 1 : DW;
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t gn = std::min<int64_t>(GB, G - g0);
    for (int64_t w0 = 0; w0 < nw; w0 += NW) {  // DW == 0 (a head size without its own build): one word block at a time
      __m512 ae[GB][NW], ao[GB][NW];
      for (int64_t gi = 0; gi < GB; ++gi)
        for (int64_t w = 0; w < NW; ++w)
          if (gi < gn) {
            const float* ag = acc + (g0 + gi) * nw * 32 + (w0 + w) * 32;
            const __m512 cv = _mm512_set1_ps(cs[g0 + gi]);
            ae[gi][w] = _mm512_mul_ps(_mm512_loadu_ps(ag), cv);
            ao[gi][w] = _mm512_mul_ps(_mm512_loadu_ps(ag + 16), cv);
          }
      for (int64_t t = 0; t < len; ++t) {
        __m512 ve[NW], vo[NW];
        for (int64_t w = 0; w < NW; ++w) {
          const __m512i vw = _mm512_loadu_si512(vrow[t] + (w0 + w) * 32);
          ve[w] = even(vw);
          vo[w] = odd(vw);
        }
        for (int64_t gi = 0; gi < GB; ++gi)
          if (gi < gn) {
            const __m512 pv = _mm512_set1_ps(pts[(g0 + gi) * 16 + t]);
            for (int64_t w = 0; w < NW; ++w) {
              ae[gi][w] = _mm512_fmadd_ps(pv, ve[w], ae[gi][w]);
              ao[gi][w] = _mm512_fmadd_ps(pv, vo[w], ao[gi][w]);
            }
          }
        pf.step((gn * NW + 1) / 2);
      }
      for (int64_t gi = 0; gi < GB; ++gi)
        for (int64_t w = 0; w < NW; ++w)
          if (gi < gn) {
            float* ag = acc + (g0 + gi) * nw * 32 + (w0 + w) * 32;
            _mm512_storeu_ps(ag, ae[gi][w]);
            _mm512_storeu_ps(ag + 16, ao[gi][w]);
          }
    }
  }
}
#endif

#if defined(DISAGG_ATTN_AVX2)
// exp(x) as exp512() in 8 lanes; 2^n built in the exponent bits (n in [-126, 127] after the clamp).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 values of a page row as fp32 (a bf16 value is the high half of its fp32: zero-extended and shifted)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Lane i of the result = the sum of the 8 lanes of a_i.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 z = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
}

// The 16 scores of GN query heads (qg: head after head, nv vectors of 8 each) against the chunk's K rows, 4 tokens at
// a time: each K vector is loaded (and widened, bf16 pages) once for the GN heads; 4 x GN accumulators + GN query
// vectors + the K vector: 16 registers at GN = 3. Forced inline, as values_avx2: GCC inlined them into one copy of
// chunk_avx2 and not into another, identical code on bf16 pages 1.11-1.23x vs 1.60-1.68x the old kernel (session
// 45, the Zen 3).
template <int64_t GN, int64_t DV, typename T>
[[gnu::always_inline]] inline void scores_avx2(const float* qg, const T* const* krow, int64_t dyn_dv, float* pts,
                                               PfCursor& pf, int64_t pfk) {
  const int64_t nv = DV > 0 ? DV : dyn_dv;
  for (int t0 = 0; t0 < 16; t0 += 4) {
    __m256 a[4][GN];
    for (int t = 0; t < 4; ++t)
      for (int64_t g = 0; g < GN; ++g) a[t][g] = _mm256_setzero_ps();
    for (int64_t v = 0; v < nv; ++v) {
      __m256 q[GN];
      for (int64_t g = 0; g < GN; ++g) q[g] = _mm256_loadu_ps(qg + g * nv * 8 + v * 8);
      for (int t = 0; t < 4; ++t) {
        const __m256 k = load8(krow[t0 + t] + v * 8);
        for (int64_t g = 0; g < GN; ++g) a[t][g] = _mm256_fmadd_ps(q[g], k, a[t][g]);
      }
      pf.step(pfk);
    }
    for (int64_t g = 0; g < GN; ++g) _mm_storeu_ps(pts + g * 16 + t0, hsum4(a[0][g], a[1][g], a[2][g], a[3][g]));
  }
}

// GN query heads' value accumulators (acc: head after head, nv vectors of 8 each) rescaled by cs and given the chunk's
// len weighted V rows (probabilities pts, 16 a head), NW vectors of each head at a time in registers: each V vector
// loaded (and widened) once for the GN heads; GN x NW accumulators + GN probabilities + the V vector: 16 at 3 x 4.
template <int64_t GN, int64_t NW, typename T>
[[gnu::always_inline]] inline void values_avx2(const T* const* vrow, int64_t len, int64_t nv, int64_t v0,
                                               const float* pts, const float* cs, float* acc, PfCursor& pf,
                                               int64_t pfk) {
  __m256 av[GN][NW];
  for (int64_t g = 0; g < GN; ++g) {
    const __m256 c = _mm256_set1_ps(cs[g]);
    for (int64_t w = 0; w < NW; ++w) av[g][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * nv * 8 + (v0 + w) * 8), c);
  }
  for (int64_t t = 0; t < len; ++t) {
    __m256 p[GN];
    for (int64_t g = 0; g < GN; ++g) p[g] = _mm256_broadcast_ss(pts + g * 16 + t);
    for (int64_t w = 0; w < NW; ++w) {
      const __m256 v = load8(vrow[t] + (v0 + w) * 8);
      for (int64_t g = 0; g < GN; ++g) av[g][w] = _mm256_fmadd_ps(p[g], v, av[g][w]);
    }
    pf.step(pfk);
  }
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t w = 0; w < NW; ++w) _mm256_storeu_ps(acc + g * nv * 8 + (v0 + w) * 8, av[g][w]);
}

// One chunk of len <= 16 tokens for the G query heads of a KV head (head size a multiple of 8), K / V rows read in
// place from fp32 or bf16 pages (rows past len point at zeros), in three loops: the scores of blocks of up to 3 heads
// (scores_avx2), every head's online-softmax update (vectorised; its chains overlap across heads), then the weighted
// values of the same blocks (values_avx2). pts / cs: G * 16 and G floats of scratch.
template <int64_t DV, typename T>
inline void chunk_avx2(const float* qf, const T* const* krow, const T* const* vrow, int64_t len, int64_t G,
                       int64_t dyn_dv, float* acc, float* m, float* l, float* pts, float* cs, PfCursor& cursor) {
  const int64_t nv = DV > 0 ? DV : dyn_dv;
  PfCursor pf = cursor;  // a local copy, kept in registers (through the reference each step stored and reloaded it)
  // the next chunk's lines (2 x 16 rows of nv * 8 values), spread over the 8 * nv steps of a block of heads (4 * nv
  // of the scores, 16 tokens x nv / 4 of the values)
  const int64_t pfk = (2 * 16 * nv * 8 * static_cast<int64_t>(sizeof(T)) / 64 + 8 * nv - 1) / (8 * nv);
  for (int64_t g0 = 0; g0 < G; g0 += 3) {  // scores
    const float* qg = qf + g0 * nv * 8;
    switch (std::min<int64_t>(3, G - g0)) {
      case 3: scores_avx2<3, DV>(qg, krow, nv, pts + g0 * 16, pf, pfk); break;
      case 2: scores_avx2<2, DV>(qg, krow, nv, pts + g0 * 16, pf, pfk); break;
      default: scores_avx2<1, DV>(qg, krow, nv, pts + g0 * 16, pf, pfk); break;
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 in0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(len)), lane));
  const __m256 in1 =
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(len) - 8), lane));
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {  // the online softmax's update
    const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(pts + g * 16), in0);
    const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(pts + g * 16 + 8), in1);
    __m256 mx = _mm256_max_ps(s0, s1);
    mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 0x01));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1));
    const __m256 mp = _mm256_max_ps(mx, _mm256_set1_ps(m[g]));  // every lane
    const __m256 p0 = _mm256_and_ps(in0, exp256(_mm256_sub_ps(s0, mp)));
    const __m256 p1 = _mm256_and_ps(in1, exp256(_mm256_sub_ps(s1, mp)));
    __m256 sum = _mm256_add_ps(p0, p1);
    sum = _mm256_add_ps(sum, _mm256_permute2f128_ps(sum, sum, 0x01));
    sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0x4E));
    sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0xB1));
    const float mpf = _mm256_cvtss_f32(mp);
    cs[g] = _mm256_cvtss_f32(exp256(_mm256_set1_ps(m[g] - mpf)));
    l[g] = l[g] * cs[g] + _mm256_cvtss_f32(sum);
    m[g] = mpf;
    _mm256_storeu_ps(pts + g * 16, p0);
    _mm256_storeu_ps(pts + g * 16 + 8, p1);
  }
  for (int64_t g0 = 0; g0 < G; g0 += 3) {  // the weighted values
    const int64_t gn = std::min<int64_t>(3, G - g0);
    const float* pg = pts + g0 * 16;
    float* ag = acc + g0 * nv * 8;
    int64_t v0 = 0;
    for (; v0 + 4 <= nv; v0 += 4) switch (gn) {
        case 3: values_avx2<3, 4>(vrow, len, nv, v0, pg, cs + g0, ag, pf, pfk); break;
        case 2: values_avx2<2, 4>(vrow, len, nv, v0, pg, cs + g0, ag, pf, pfk); break;
        default: values_avx2<1, 4>(vrow, len, nv, v0, pg, cs + g0, ag, pf, pfk); break;
      }
    if constexpr (DV == 0 || DV % 4 != 0)  // the vectors past the blocks of 4, one at a time
      for (; v0 < nv; ++v0) switch (gn) {
          case 3: values_avx2<3, 1>(vrow, len, nv, v0, pg, cs + g0, ag, pf, pfk); break;
          case 2: values_avx2<2, 1>(vrow, len, nv, v0, pg, cs + g0, ag, pf, pfk); break;
          default: values_avx2<1, 1>(vrow, len, nv, v0, pg, cs + g0, ag, pf, pfk); break;
        }
  }
  cursor = pf;
}
#endif

// n values (fp32 or bf16 pages) as fp32: a bf16 value is the high half of its fp32, so 8 (16) at a time are a
// zero-extension and a shift (bf16 pages on AVX-512 with a head size that is not a multiple of 32, and the plain
// loops: each K / V row once per chunk, shared by the G query heads; chunk_avx2 reads bf16 pages in place).
template <typename T>
inline void to_floats(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
  }
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// The same chunk with plain loops (any head size, any CPU).
inline void chunk_plain(const float* qf, const float* const* krow, const float* const* vrow, int64_t len, int64_t G,
                        int64_t D, float* acc, float* m, float* l, float* sc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    float mp = m[g];
    for (int64_t t = 0; t < len; ++t) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * krow[t][d];
      sc[t] = dot;
      mp = std::max(mp, dot);
    }
    const float c = std::exp(m[g] - mp);
    float sum = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      sc[t] = std::exp(sc[t] - mp);
      sum += sc[t];
    }
    l[g] = l[g] * c + sum;
    m[g] = mp;
    float* ag = acc + g * D;
    for (int64_t d = 0; d < D; ++d) ag[d] *= c;
    for (int64_t t = 0; t < len; ++t)
      for (int64_t d = 0; d < D; ++d) ag[d] += sc[t] * vrow[t][d];
  }
}

// Token t's page (index into the sequence's page row) and offset in it, walked token by token without a division
// per token (a 64-bit division is ~15 cycles here, and the page size is known only at run time).
struct PageWalk {
  int64_t page, offset, P;
  PageWalk(int64_t t, int64_t p) : page(t / p), offset(t % p), P(p) {}
  void next() {
    if (++offset == P) {
      offset = 0;
      ++page;
    }
  }
};

// Every cache line of the K / V of tokens [t0, t1) (all H heads) loaded and discarded, with independent loads back
// to back: run on a range's first chunk (the rest is prefetched by PfCursor). Until session 43 AMD's AVX-512 builds
// ran it on each window of ~256 KB of chunks: the chunks' own loads (a prefetch one chunk ahead included) had waited
// on each line — SmolLM2's 30 layers of attention (3 KV heads of 64, bf16 pages, 290 tokens, one thread, after the
// weights' stream evicted the KV) took 0.6-1.0 ms at batch 1 and 4.9-7.9 ms at batch 8 (7-11 GB/s), 0.29 / 2.0 ms
// with the KV in cache; no prefetch distance or hint changed that, touching each window first did (AVX-512 Zen 4,
// 2026-12-03). Touched in address order: in HND pages each (head, K / V) slice's tokens as one run of lines, a page
// at a time (token after token across the 2H slices was 2H interleaved streams of 128 bytes each: the same Zen 4,
// session 38, alternated in one process: the step 1.045x faster at batch 1 (context 256 -> 1,256) and 1.05-1.08x at
// batch 8, one thread). Prefetching the next layer's K / V during this layer's GEMMs, prefetches instead of loads
// here, and touching a thread's whole layer first were each slower (the same session). On Intel's cores (an Emerald
// Rapids Xeon, session 40) a run of loads waits on memory's latency (a page's 12 KB at ~8 GB/s): there a range's
// first chunk only was touched and the rest prefetched spread over the compute (PfCursor; session 41), and on a Zen 5
// too (session 43: see PfCursor).
template <typename T>
inline void touch_range(const T* pool, int64_t H, int64_t head_stride, const int64_t* row, int64_t t0, int64_t t1,
                        int64_t D, int64_t P, int64_t page_stride, int64_t kv_stride, int64_t token_stride) {
  constexpr int64_t LINE = 64 / static_cast<int64_t>(sizeof(T));
#if defined(__AVX512F__)
  __m512i sink = _mm512_setzero_si512();
  auto touch = [&](const T* p) { sink = _mm512_or_si512(sink, _mm512_loadu_si512(p)); };
#else
  uint32_t sink = 0;
  auto touch = [&](const T* p) {
    uint32_t w;
    std::memcpy(&w, p, sizeof w);
    sink ^= w;
  };
#endif
  if (token_stride == D) {  // HND: a page's (head, K / V) slices hold their tokens one after the other
    for (int64_t t = t0; t < t1;) {
      const int64_t off = t % P, n = std::min(P - off, t1 - t);
      const T* pb = pool + row[t / P] * page_stride + off * token_stride;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t kv = 0; kv < 2; ++kv) {
          const T* run = pb + h * head_stride + kv * kv_stride;
          for (int64_t i = 0; i < n * D; i += LINE) touch(run + i);
        }
      t += n;
    }
  } else {  // NHD: a token's heads and K / V lie together, so token after token is address order
    PageWalk at(t0, P);
    for (int64_t t = t0; t < t1; ++t, at.next()) {
      const T* b = pool + row[at.page] * page_stride + at.offset * token_stride;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; d += LINE) {
          touch(b + h * head_stride + d);
          touch(b + h * head_stride + kv_stride + d);
        }
    }
  }
#if defined(__AVX512F__)
  asm volatile("" : : "v"(sink));  // the loads are kept: their value is used
#else
  asm volatile("" : : "r"(sink));
#endif
}

// The bf16 pages' query, prepared once for every part of a sequence it attends (split path: bf16 pool, a
// head size that is a multiple of 32, AVX-512): qsplit [Q * D] = each head in split order, qhl [Q * 2 * D] =
// each head as bf16 hi and lo parts (q ~= hi + lo to 16 bits; see chunk_bf16_avx512).
inline void prepare_query(const float* qf, int64_t Q, int64_t D, float* qsplit, uint16_t* qhl) {
  const bool hi_lo = scores_by_dpbf16();  // (the FMA path reads qsplit only)
  for (int64_t i = 0; i < Q; ++i) {
    int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int64_t v = 0; v < D / 32; ++v) {  // split(), 32 values at a time
      const __m512 a = _mm512_loadu_ps(qf + i * D + v * 32), b = _mm512_loadu_ps(qf + i * D + v * 32 + 16);
      _mm512_storeu_ps(qsplit + i * D + v * 32, _mm512_permutex2var_ps(a, evens, b));
      _mm512_storeu_ps(qsplit + i * D + v * 32 + 16, _mm512_permutex2var_ps(a, odds, b));
    }
    // round to nearest even, as at::BFloat16 does (a query is finite)
    auto round16 = [](__m512 x) {
      const __m512i b = _mm512_castps_si512(x);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
      return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    };
    for (; hi_lo && d + 16 <= D; d += 16) {
      const __m512 x = _mm512_loadu_ps(qf + i * D + d);
      const __m512i hi = round16(x);
      const __m512i lo = round16(_mm512_sub_ps(x, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qhl + i * 2 * D + d), _mm512_cvtepi32_epi16(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qhl + i * 2 * D + D + d), _mm512_cvtepi32_epi16(lo));
    }
#else
    split(qf + i * D, qsplit + i * D, D);
#endif
    for (; hi_lo && d < D; ++d) {
      const at::BFloat16 hi(qf[i * D + d]);
      const at::BFloat16 lo(qf[i * D + d] - static_cast<float>(hi));
      qhl[i * 2 * D + d] = hi.x;
      qhl[i * 2 * D + D + d] = lo.x;
    }
  }
}

// The K / V of the chunk starting at token cs, one pointer a token (K of KV head 0; V at + kv_stride).
template <typename T>
inline int64_t chunk_rows(const T* pool, const int64_t* row, int64_t cs, int64_t t1, int64_t P, int64_t page_stride,
                          int64_t token_stride, const T** base) {
  const int64_t len = std::min(CHUNK, t1 - cs);
  PageWalk at(cs, P);
  for (int64_t t = 0; t < len; ++t, at.next()) base[t] = pool + row[at.page] * page_stride + at.offset * token_stride;
  return len;
}

#if defined(__AVX512F__)
// attend_range() on the split path with the query prepared (prepare_query) and the accumulators asplit kept
// in split order (unsplit() each head once its parts are merged). scratch: scratch_floats() floats. Chunks
// are prefetched one ahead up to token `ahead` (>= t1: a part of a sequence prefetches the next part's first
// chunk; parts of 32 tokens lost 10 % without it).
template <int64_t KD>
void attend_split(const float* qsplit, const uint16_t* qhl, const at::BFloat16* pool, int64_t H, int64_t head_stride,
                  const int64_t* row, int64_t t0, int64_t t1, int64_t ahead, int64_t G, int64_t dyn_d, int64_t P,
                  int64_t page_stride, int64_t kv_stride, int64_t token_stride, float* asplit, float* m, float* l,
                  float* scratch) {
  const int64_t D = KD > 0 ? KD : dyn_d;
  float* zeros = scratch;  // D floats: the rows past a short chunk's end
  float* pts = scratch + D;
  [[maybe_unused]] float* rescale = pts + G * CHUNK;
  std::fill(zeros, zeros + D, 0.0f);
  const uint16_t* zero16 = reinterpret_cast<const uint16_t*>(zeros);
  const at::BFloat16* base[CHUNK];
  const at::BFloat16* next[CHUNK];  // the next chunk's K of head 0
  const char* lines[CHUNK];
  const bool dpbf16 = scores_by_dpbf16();
  for (int64_t cs = t0; cs < t1; cs += CHUNK) {
    if (cs == t0)
      touch_range(pool, H, head_stride, row, cs, std::min(cs + CHUNK, t1), D, P, page_stride, kv_stride, token_stride);
    const int64_t len = chunk_rows(pool, row, cs, t1, P, page_stride, token_stride, base);
    const int64_t next_len =
        cs + CHUNK < ahead ? chunk_rows(pool, row, cs + CHUNK, ahead, P, page_stride, token_stride, next) : 0;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < next_len; ++t) lines[t] = reinterpret_cast<const char*>(next[t] + h * head_stride);
      PfCursor pf{lines, next_len, kv_stride * 2, (D * 2 + 63) / 64, 0};
      const uint16_t* kb[CHUNK];
      const uint16_t* vb[CHUNK];
      for (int64_t t = 0; t < CHUNK; ++t) {
        const at::BFloat16* k = t < len ? base[t] + h * head_stride : nullptr;
        kb[t] = k != nullptr ? reinterpret_cast<const uint16_t*>(k) : zero16;
        vb[t] = k != nullptr ? reinterpret_cast<const uint16_t*>(k + kv_stride) : zero16;
      }
      if (dpbf16)
        chunk_bf16_avx512<KD / 32, true>(qsplit + h * G * D, qhl + h * G * 2 * D, kb, vb, len, G, D / 32,
                                         asplit + h * G * D, m + h * G, l + h * G, pts, rescale, pf);
      else
        chunk_bf16_avx512<KD / 32, false>(qsplit + h * G * D, qhl + h * G * 2 * D, kb, vb, len, G, D / 32,
                                          asplit + h * G * D, m + h * G, l + h * G, pts, rescale, pf);
      pf.finish();
    }
  }
}
#endif

// Tokens [t0, t1) of a sequence whose pages are `row` (page i holds tokens [i * P, (i + 1) * P)), for all
// H KV heads at once: a chunk of tokens is read head after head, which walks each page in address order
// (reading one head's slice of every page instead runs at a third of the bandwidth here). `pool` points at
// KV head 0's K of page 0 token 0; head h at + h * head_stride, V at + kv_stride. qf: the H * G query
// heads (G per KV head), fp32, already scaled. Updates acc [H * G * D] (unnormalised), m and l [H * G]
// (start them at 0, -inf, 0).
template <typename T, int64_t KD>
void attend_range(const float* qf, const T* pool, int64_t H, int64_t head_stride, const int64_t* row, int64_t t0,
                  int64_t t1, int64_t G, int64_t dyn_d, int64_t P, int64_t page_stride, int64_t kv_stride,
                  int64_t token_stride, float* acc, float* m, float* l, float* scratch) {
  const int64_t D = KD > 0 ? KD : dyn_d;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (D % 32 == 0) {  // the split path: the query prepared, the accumulators split, and back at the end
      float* qsplit = scratch + 3 * CHUNK * D + 2 * CHUNK;
      float* asplit = qsplit + H * G * D;
      uint16_t* qhl = reinterpret_cast<uint16_t*>(asplit + H * G * D);  // H * G * 2 * D bf16
      prepare_query(qf, H * G, D, qsplit, qhl);
      for (int64_t i = 0; i < H * G; ++i) split(acc + i * D, asplit + i * D, D);
      attend_split<KD>(qsplit, qhl, pool, H, head_stride, row, t0, t1, t1, G, D, P, page_stride, kv_stride,
                       token_stride, asplit, m, l, scratch);
      for (int64_t i = 0; i < H * G; ++i) unsplit(asplit + i * D, acc + i * D, D);
      return;
    }
  }
#endif
  float* kbuf = scratch;
  float* vbuf = scratch + CHUNK * D;
  float* zeros = scratch + 2 * CHUNK * D;  // D floats: the rows past a short chunk's end
  float* sc = scratch + 3 * CHUNK * D;
  float* pts = sc + 2 * CHUNK;  // G * CHUNK + G floats: the chunk kernels' probabilities and rescales
  [[maybe_unused]] float* rescale = pts + G * CHUNK;
  std::fill(zeros, zeros + D, 0.0f);
  const T* base[CHUNK];  // each token's K of head 0
  const float* krow[CHUNK];
  const float* vrow[CHUNK];
  // the first chunk touched; each next one prefetched a few lines at a time from inside the chunk kernel
  // (PfCursor); the plain kernel takes the cursor's lines after each head
  const T* next[CHUNK];  // the next chunk's K of head 0
  const char* lines[CHUNK];
  for (int64_t cs = t0; cs < t1; cs += CHUNK) {
    if (cs == t0)
      touch_range(pool, H, head_stride, row, cs, std::min(cs + CHUNK, t1), D, P, page_stride, kv_stride, token_stride);
    const int64_t len = chunk_rows(pool, row, cs, t1, P, page_stride, token_stride, base);
    const int64_t next_len =
        cs + CHUNK < t1 ? chunk_rows(pool, row, cs + CHUNK, t1, P, page_stride, token_stride, next) : 0;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < next_len; ++t) lines[t] = reinterpret_cast<const char*>(next[t] + h * head_stride);
      PfCursor pf{lines, next_len, kv_stride * static_cast<int64_t>(sizeof(T)),
                  (D * static_cast<int64_t>(sizeof(T)) + 63) / 64, 0};
      const float* qh = qf + h * G * D;
      float *ah = acc + h * G * D, *mh = m + h * G, *lh = l + h * G;
#if defined(DISAGG_ATTN_AVX2)
      if (D % 8 == 0) {  // K / V read in place, fp32 or bf16
        const T* kr[CHUNK];
        const T* vr[CHUNK];
        for (int64_t t = 0; t < CHUNK; ++t) {
          const T* k = t < len ? base[t] + h * head_stride : nullptr;
          kr[t] = k != nullptr ? k : reinterpret_cast<const T*>(zeros);
          vr[t] = k != nullptr ? k + kv_stride : reinterpret_cast<const T*>(zeros);
        }
        chunk_avx2<KD / 8, T>(qh, kr, vr, len, G, D / 8, ah, mh, lh, pts, rescale, pf);
        pf.finish();
        continue;
      }
#endif
      for (int64_t t = 0; t < len; ++t) {
        const T* k = base[t] + h * head_stride;
        if constexpr (std::is_same_v<T, float>) {
          krow[t] = k;
          vrow[t] = k + kv_stride;
        } else {
          to_floats(k, kbuf + t * D, D);
          to_floats(k + kv_stride, vbuf + t * D, D);
          krow[t] = kbuf + t * D;
          vrow[t] = vbuf + t * D;
        }
      }
      for (int64_t t = len; t < CHUNK; ++t) krow[t] = vrow[t] = zeros;
#if defined(__AVX512F__)
      if (D % 16 == 0) {
        chunk_avx512<KD / 16>(qh, krow, vrow, len, G, D / 16, ah, mh, lh, pts, rescale, pf);
        pf.finish();
        continue;
      }
#endif
      chunk_plain(qh, krow, vrow, len, G, D, ah, mh, lh, sc);
      pf.finish();
    }
  }
}

// out [G * D] = the normalised combination of S partial states (acc [G * D], m [G], l [G] each, at
// stride `part` floats: acc first, then m, then l); heads [g0, g1) only if given. Parts in order, each
// weighted by exp(its m - the largest m), a head's D values at a time (vectorised over D).
inline void merge(const float* parts, int64_t S, int64_t part, int64_t G, int64_t D, float* out, int64_t g0 = 0,
                  int64_t g1 = -1) {
  for (int64_t g = g0; g < (g1 < 0 ? G : g1); ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < S; ++s) mx = std::max(mx, parts[s * part + G * D + g]);
    float* o = out + g * D;
    std::fill(o, o + D, 0.0f);
    float denom = 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      const float* p = parts + s * part;
      const float w = std::exp(p[G * D + g] - mx);
      denom += p[G * D + G + g] * w;
      const float* a = p + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += a[d] * w;
    }
    const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

// The whole sequence (its first n tokens), every head: q [H * G * D] in QT, out [H * G * D] in OT. Scratch:
// qf and acc H * G * D floats each, m and l H * G each, and scratch_floats(D) more.
template <typename QT, typename T, typename OT, int64_t KD>
void decode_job(const QT* q, const T* pool, int64_t H, int64_t head_stride, const int64_t* row, int64_t n, OT* out,
                int64_t G, int64_t dyn_d, int64_t P, int64_t page_stride, int64_t kv_stride, int64_t token_stride,
                float scale, float* qf, float* acc, float* m, float* l, float* scratch) {
  const int64_t D = KD > 0 ? KD : dyn_d, Q = H * G;
  for (int64_t i = 0; i < Q * D; ++i) qf[i] = to_float(q[i]) * scale;
  std::fill(acc, acc + Q * D, 0.0f);
  std::fill(m, m + Q, -std::numeric_limits<float>::infinity());
  std::fill(l, l + Q, 0.0f);
  attend_range<T, KD>(qf, pool, H, head_stride, row, 0, n, G, D, P, page_stride, kv_stride, token_stride, acc, m, l,
                      scratch);
  for (int64_t g = 0; g < Q; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<OT>(acc[g * D + d] * inv);
  }
}

}  // namespace disagg_attn
