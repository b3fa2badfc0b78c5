// Integer GEMM over block-quantized weights (Q8_0 / Q6_K / Q5_K / Q5_0 / Q5_1 / Q4_K / Q4_0 / Q4_1 / IQ4_NL / Q3_K /
// Q2_K, blocks of 32 along K) and activations quantized to int8 per 32-block, as llama.cpp computes:
// y[r, n] = sum_b d_b(n) * dx_b(r) * sum_i q_i * xq_i (+ the format's offset term). Shared by gemm_quant.cpp
// (the Python-facing GEMM) and decode_step.cpp (the fused decode step), so both compute bit-identical results.
//
// Weights are repacked once at load ("Q16", repack() in gemm_quant.cpp) with GROUP = 16 output rows
// interleaved: for each group and each 32-block, 64-byte chunks whose byte j * 4 + i belongs to output j
// of the group and to 4 consecutive k. One chunk is one vector of 16 outputs x 4 k: `vpdpbusd` multiplies
// it with 4 broadcast activation bytes and accumulates 16 outputs at once, with no horizontal sums.
//   Q4: 4 chunks a block; chunk c's low nibbles are k = 8c..8c+3, its high nibbles k = 8c+4..8c+7. IQ4_NL too, its
//       nibbles indices into a table of 16 int8 values (a byte shuffle: AVX-512 looks up value + 128, unsigned).
//   Q8: 8 chunks a block; chunk c holds k = 4c..4c+3 (signed bytes).
//   Q5 (Q5_0, Q5_1): Q4's 4 chunks (the low 4 bits), then 8 64-bit words of the 5th bits: word v = 2c + h
//       stands for the vector of chunk c's low (h = 0) or high (h = 1) nibbles, its bit j * 4 + i the 5th bit
//       of that vector's byte j * 4 + i (an AVX-512 byte mask as it stands; AVX2 takes its half's 32 bits).
//   Q6_K: Q4's 4 chunks, then 2 chunks of the top two bits: byte b of chunk 4 + u holds, at bits 2t, those of
//       byte b of vector v = 4u + t (chunk v / 2's low (v even) or high nibbles); q in 0..63 stands for q - 32.
//   Q3_K: 2 chunks of the low two bits (byte b of chunk u holds, at bits 2t, those of byte b of vector v = 4u + t,
//       vectors as Q4's), then 8 64-bit words of the 3rd bits (as Q5's 5th); q in 0..7 stands for q - 4. Its
//       scales as Q6_K's (d per 256, an int8 scale per 16).
//   Q2_K: Q3_K's 2 chunks of crumbs alone; q in 0..3. Its d and dmin per 256 as Q4_K's, and as `m` each half block's
//       byte as the file holds it, [group][block][2][16]: the 4-bit scale in its low nibble, the minimum in its high;
//       a weight is (d * sc) * q - (dmin * mn), its integer sums taken per half block and weighted by sc in int32.
//   Scales (and Q4_1 / Q5_1 minimums): [group][block][16] fp16. Rows past N (the last group's padding) are 0.
//   Q4_K / Q5_K (Q4's / Q5's layout) keep GGUF's two-level scales: d [group][super-block of 256][d, dmin][16] fp16,
//   and as `m` [group][block][scale, minimum][16] uint8 (6 bits each); a weight is (d * sc) * q - dmin * mn, the
//   block's float scale and minimum made per block (exact in fp32) and used as Q4_1 / Q5_1 use theirs.
//   Q6_K (and Q3_K) keep GGUF's two-level scales: d [group][super-block of 256][16] fp16, and as `m` the sub-block
//   scales [group][block][2][16] int8 (the block's first 16 weights', then its last 16's); a weight is
//   d * sc * (q - 32) (Q3_K: q - 4). Its integer sums are taken per half block and weighted by sc in int32 (exact).
//
// Activations (ActQ8, quantize_rows()): per row and 32-block, dx = max|x| / 127, q = round(x / dx) in
// [-127, 127] (nearest, ties to even), s = sum(q) (and dx * s; slo, the sum of the first 16, and dx * slo). The
// error of the product is that of the activations' rounding (|x - dx * q| <= dx / 2 per element); the weight side is
// exact.
//
// Paths, picked by the compiler flags this file is built with (-march=native: the CPU at hand):
//   avx512-vnni  vpdpbusd (u8 x s8 -> s32) on 512-bit vectors; Q8 weights offset by +128 (u8) and the
//                offset's 128 * s taken off again; Q5's 5th bits added under their byte masks (up to 32 rows
//                tiles of 16 and of 9-15 first; past 32 rows each group of Q5 / Q6_K / Q3_K / IQ4_NL unpacked once to
//                a byte a weight: groups_unpacked);
//   avx2         vpmaddubsw + vpmaddwd (llama.cpp's AVX2 way); Q8 and IQ4_NL by the sign trick (|w| x sign(x, w));
//   scalar       plain loops (any CPU).
// Each computes the same integer sums; only the float accumulation order differs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_vendor.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DISAGG_I8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DISAGG_I8_AVX2 1
#endif

namespace disagg_q {

constexpr int64_t BLOCK = 32;
constexpr int64_t GROUP = 16;
// GGML's type ids; and U8_MIN / U8_K5 / U8_Q6K / U8_Q2K, never stored: a Q5_1 / Q5_K / Q6_K (or Q3_K) / Q2_K group
// unpacked to one unsigned byte a weight (Q8's layout, the q of 0..31 / 0..63 as they are (Q3_K's + 28; Q2_K's times
// their 4-bit scale), the source's scales and minimums), which AVX-512 computes past 32 rows.
enum Kind : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20,
  U8_MIN = 1007, U8_Q2K = 1010, U8_K5 = 1013, U8_Q6K = 1014
};
inline bool known_kind(int64_t k) {
  return k == Q4_0 || k == Q4_1 || k == Q5_0 || k == Q5_1 || k == Q8_0 || k == Q4_K || k == Q5_K || k == Q6_K ||
         k == IQ4_NL || k == Q3_K || k == Q2_K;
}
// IQ4_NL's values (llama.cpp's kvalues_iq4nl): a weight is d times the one its nibble picks.
alignas(16) constexpr int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                  1,    13,   25,  38,  53,  69,  89,  113};
constexpr bool two_level(Kind k) { return k == Q4_K || k == Q5_K || k == U8_K5; }  // d, dmin per 256; u8 sc, mn
constexpr bool has_min(Kind k) { return k == Q4_1 || k == Q5_1 || k == U8_MIN || two_level(k); }  // + m * dx * s
constexpr int high_planes(Kind k) {  // bits a weight above the nibble: Q5's 5th (words), Q6_K's top two (crumbs)
  return k == Q5_0 || k == Q5_1 || k == Q5_K ? 1 : (k == Q6_K ? 2 : 0);
}
constexpr bool has_high(Kind k) { return high_planes(k) > 0; }
constexpr bool unpacks(Kind k) {  // past UNPACK_ROWS rows each group is unpacked first (groups_unpacked)
#if defined(DISAGG_I8_AVX512)
  return k == Q5_0 || k == Q5_1 || k == Q5_K || k == Q6_K || k == IQ4_NL || k == Q3_K || k == Q2_K;
#elif defined(DISAGG_I8_AVX2)
  return k == Q3_K;
#else
  static_cast<void>(k);
  return false;
#endif
}
constexpr bool byte_quants(Kind k) {  // a byte each
  return k == Q8_0 || k == U8_MIN || k == U8_K5 || k == U8_Q6K || k == U8_Q2K;
}
// How far ahead the weight stream is prefetched, every cache line of the block that far ahead (one line a block
// left the hardware prefetcher 3 of a Q4 block's 4 lines: the fused step's GEMMs streamed at ~0.7 of the read
// bandwidth at one row, at ~1.0 with every line; SmolLM2's batch-1 step -20 %): at one row 32 blocks (8 KB of Q4,
// 16 KB of Q8; the groups lie one after the other, so this runs into the next group), with more rows each block takes
// longer and 8 ahead is enough (A/B on the AVX-512 Zen 4, 2026-12-02: 32 / 8 vs 16 / 4 equal at one row, -3-8 % at 8
// rows). Q8_0 at two rows (the lm_head's `precise` pair at batch 1) still reads at the memory's pace and took 16
// (session 38, the same Zen 4, alternated in one process: SmolLM2's batch-1 step 1.017x / 1.034x faster at one / two
// threads; 16 for every kind at two rows left the batch-2 step 0.97-1.0x). Since session 43 2-4 rows take 32 and 5-8
// rows 16: on a Zen 5 (family 26 model 2, a model's GEMMs from DRAM, cold_gemm.txt, alternated in one process) the
// GEMMs of 2 / 3 / 4 rows ran 1.23 / 1.27 / 1.21x faster with 32 (1.14-1.16x with 16), 8 rows 1.14x with 16 (32
// no better), 9-16 rows no faster (0.97-1.0x); an Emerald Rapids had shown 16 at 4-8 rows 1.01-1.06x (session 42).
template <int64_t BB>
inline void prefetch_block(const uint8_t* p) {
  for (int64_t c = 0; c < BB; c += 64) __builtin_prefetch(p + c, 0, 3);
}
template <Kind KD, int R>
constexpr int64_t prefetch_blocks() {
  return R <= 4 ? 32 : (R <= 8 ? 16 : 8);
}
constexpr bool q2_mins(Kind k) { return k == Q2_K || k == U8_Q2K; }  // Q2_K's minimum per 16 weights
constexpr bool sub_scales(Kind k) {  // a scale per 16 weights (int8; Q2_K: 4 bits, beside a 4-bit minimum)
  return k == Q6_K || k == U8_Q6K || k == Q3_K || k == Q2_K;
}
constexpr bool has_dmin(Kind k) { return two_level(k) || q2_mins(k); }  // d, dmin per 256
template <Kind KD>
constexpr int32_t sub_offset() {  // where a sub-scaled half block's integer sum starts: -32 s (Q3_K: -4 s; Q2_K: 0)
  return KD == Q3_K ? -4 : (KD == Q2_K ? 0 : -32);
}
constexpr int64_t bits_at(Kind k) { return k == Q3_K ? 128 : 256; }  // where a block's words of single bits start
constexpr int64_t scale_span(Kind k) {  // weights along K per entry of d: 32; Q6_K one per 256; Q4_K / Q5_K two
  return has_dmin(k) ? 128 : (sub_scales(k) ? 256 : 32);
}
constexpr int64_t d_entry(Kind k, int64_t b) {  // block b's entry of d (Q4_K / Q5_K: its super-block's d; dmin next)
  return has_dmin(k) ? b / 8 * 2 : (sub_scales(k) ? b / 8 : b);
}

inline const char* i8_path() {
#if defined(DISAGG_I8_AVX512)
  return "avx512-vnni";
#elif defined(DISAGG_I8_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

inline float fp16_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// A repacked weight [N, K] (see the top of the file).
struct Q16 {
  Kind kind = Q8_0;
  int64_t N = 0, K = 0;
  const uint8_t* qs = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;  // has_min: fp16 minimums; Q6_K / Q3_K: int8 scales; Q4_K / Q5_K / Q2_K: u8
  int64_t first_group = 0;      // qs starts at this group (a Q5 group's copy unpacked to a byte a weight)
  int64_t NB() const { return K / BLOCK; }
  int64_t groups() const { return (N + GROUP - 1) / GROUP; }
  static constexpr int64_t block_bytes(Kind k) {
    return byte_quants(k) ? 512 : (k == Q3_K ? 192 : (k == Q2_K ? 128 : 256 + 64 * high_planes(k)));
  }
  int64_t d_blocks() const { return K / scale_span(kind); }  // entries of d per group and output
  int64_t group_bytes() const { return NB() * block_bytes(kind); }
  const uint8_t* group_qs(int64_t g) const { return qs + (g - first_group) * group_bytes(); }
};

// R rows of activations quantized per 32-block.
struct ActQ8 {
  const int8_t* q = nullptr;   // [R, K]
  const float* dx = nullptr;   // [R, NB]
  const int32_t* s = nullptr;  // [R, NB]
  const float* dxs = nullptr;  // [R, NB]: dx * s (the minimum's term)
  const int32_t* slo = nullptr;  // [R, NB]: the sum of each block's first 16 quants (Q6_K's two halves)
  const float* dxlo = nullptr;   // [R, NB]: dx * slo (Q2_K's first half's minimum term)
  int64_t K = 0;
};

// ---- activations -------------------------------------------------------------------------------------

// A block's scale d = amax / 127 and its inverse; a block whose inverse overflows (amax under ~3.7e-37: subnormal
// scales) quantizes as an all-zero block (d = 0, quants 0) — its values are below 1e-36 — where x * inf had made every
// quant -127 and the sums garbage (found by tests/test_int8_kernels.py's subnormal block, session 44).
inline void block_scale(float amax, float& d, float& id) {
  d = amax / 127.0f;
  id = d > 0.0f ? 1.0f / d : 0.0f;
  if (id > std::numeric_limits<float>::max()) d = id = 0.0f;
}

// One 32-block of activations -> its quants, scale and quant sum.
inline void quantize_block(const float* xb, int8_t* qb, float* dx, int32_t* s, float* dxs, int32_t* slo,
                           float* dxlo) {
#if defined(__AVX512F__)
  const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  float d, id;
  block_scale(amax, d, id);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
  const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(i1));
  *s = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  *slo = _mm512_reduce_add_epi32(i0);
#elif defined(__AVX2__)
  // The scalar loop below in 8 lanes, bit for bit (cvtps rounds to nearest even, as nearbyint): it was that loop on
  // AVX2-only CPUs, 6.5 % of a 256-token prefill's time on a Zen 3 (perf, session 44); 5x faster alone.
  __m256 v[4];
  __m256 amax8 = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_loadu_ps(xb + 8 * c);
    amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, v[c]), amax8);  // (a NaN value is passed over, as std::max does)
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float d, id;
  block_scale(_mm_cvtss_f32(m4), d, id);
  __m256i i[4];
  for (int c = 0; c < 4; ++c)  // (a NaN or infinite x converts to INT_MIN, clamped to -127 as the loop's clamp does)
    i[c] = _mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[c], _mm256_set1_ps(id))), _mm256_set1_epi32(-127));
  const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const auto hsum = [](__m256i a) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
  };
  const __m256i lo = _mm256_add_epi32(i[0], i[1]);
  *slo = hsum(lo);
  *s = hsum(_mm256_add_epi32(lo, _mm256_add_epi32(i[2], i[3])));
#else
  float amax = 0.0f;
  for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
  float d, id;
  block_scale(amax, d, id);
  int32_t sum = 0;
  for (int64_t i = 0; i < BLOCK; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * id));
    qb[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
    sum += qb[i];
    if (i == BLOCK / 2 - 1) *slo = sum;
  }
  *s = sum;
#endif
  *dx = d;
  *dxs = d * static_cast<float>(*s);
  *dxlo = d * static_cast<float>(*slo);
}

// Rows [r0, r1) of x [*, K] (fp32) -> q, dx, s, dxs, slo, dxlo (each row's blocks in order).
inline void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t K, int8_t* q, float* dx, int32_t* s,
                          float* dxs, int32_t* slo, float* dxlo) {
  const int64_t NB = K / BLOCK;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < NB; ++b) {
      const int64_t i = r * NB + b;
      quantize_block(x + r * K + b * BLOCK, q + r * K + b * BLOCK, dx + i, s + i, dxs + i, slo + i, dxlo + i);
    }
}

// ---- the kernels: one group of 16 outputs for a tile of R rows ---------------------------------------
// y[(r0 + r) * ldy + g * 16 + j] = sum over blocks (+ bias[g * 16 + j]) for j < 16 and g * 16 + j < N.

// Where a block's integer sum starts: the format's offset times the activations' quant sum s (Q4_0's -8,
// Q5_0's -16; Q8_0 on AVX-512 its +128 u8 offset; Q4_1 / Q5_1 none: their minimum is a float term).
template <Kind KD>
constexpr int32_t offset() {
  return KD == Q4_0 ? -8 : (KD == Q5_0 ? -16 : 0);
}
// AVX-512's: Q8_0 and IQ4_NL take their signed values as unsigned bytes + 128, and take 128 s off again.
template <Kind KD>
constexpr int32_t u8_offset() {
  return KD == Q8_0 || KD == IQ4_NL ? -128 : offset<KD>();
}

// Q5: word v of a block's 5th bits (Q3_K: its 3rd bits, at bits_at(Q3_K))
inline uint64_t high_bits(const uint8_t* qb, int v, int64_t at = bits_at(Q5_0)) {
  uint64_t bits;
  std::memcpy(&bits, qb + at + 8 * v, sizeof bits);
  return bits;
}

// The bits above the nibble of byte jb (= j * 4 + i) of a block's vector v, in place (<< 4): Q5's 5th, Q6_K's two.
inline int high_value(Kind k, const uint8_t* qb, int v, int jb) {
  if (k == Q6_K) return ((qb[256 + 64 * (v / 4) + jb] >> (2 * (v % 4))) & 3) << 4;
  return has_high(k) ? static_cast<int>((high_bits(qb, v) >> jb) & 1) << 4 : 0;
}

// The unsigned quant of byte jb of a (not byte_quants) block's vector v, every bit of it.
inline int quant_at(Kind k, const uint8_t* qb, int v, int jb) {
  if (k == Q2_K) return (qb[64 * (v / 4) + jb] >> (2 * (v % 4))) & 3;
  if (k == Q3_K)
    return ((qb[64 * (v / 4) + jb] >> (2 * (v % 4))) & 3) | static_cast<int>(((high_bits(qb, v, bits_at(Q3_K)) >> jb) & 1) << 2);
  const uint8_t byte = qb[(v / 2) * 64 + jb];
  return ((v % 2 ? byte >> 4 : byte) & 0x0F) | high_value(k, qb, v, jb);
}

// accumulate: y += the result (a residual add) instead of y = the result.
inline void store_group(const float* vals, float* y, const float* bias, int64_t n0, int64_t N, bool accumulate) {
  const int64_t n = std::min<int64_t>(GROUP, N - n0);
  for (int64_t j = 0; j < n; ++j)
    y[n0 + j] = (accumulate ? y[n0 + j] : 0.0f) + vals[j] + (bias != nullptr ? bias[n0 + j] : 0.0f);
}

#if defined(DISAGG_I8_AVX512)
// Q6_K: the top two bits of each of a block's 8 vectors (their crumbs, see the top of the file) or-ed in as 0x10 /
// 0x20. 16-bit shifts carry bits across bytes only into positions the 0x30 mask drops.
inline void six_bits512(const uint8_t* qb, __m512i wv[8]) {
  const __m512i top = _mm512_set1_epi8(0x30);
  for (int u = 0; u < 2; ++u) {
    const __m512i hv = _mm512_loadu_si512(qb + 256 + 64 * u);
    wv[4 * u] = _mm512_or_si512(wv[4 * u], _mm512_and_si512(_mm512_slli_epi16(hv, 4), top));
    wv[4 * u + 1] = _mm512_or_si512(wv[4 * u + 1], _mm512_and_si512(_mm512_slli_epi16(hv, 2), top));
    wv[4 * u + 2] = _mm512_or_si512(wv[4 * u + 2], _mm512_and_si512(hv, top));
    wv[4 * u + 3] = _mm512_or_si512(wv[4 * u + 3], _mm512_and_si512(_mm512_srli_epi16(hv, 2), top));
  }
}

// Q2_K: a block's 8 vectors of 2-bit quants out of its 2 chunks of crumbs.
inline void two_bits512(const uint8_t* qb, __m512i wv[8]) {
  const __m512i two = _mm512_set1_epi8(0x03);
  for (int u = 0; u < 2; ++u) {
    const __m512i c = _mm512_loadu_si512(qb + 64 * u);
    wv[4 * u] = _mm512_and_si512(c, two);
    wv[4 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(c, 2), two);
    wv[4 * u + 2] = _mm512_and_si512(_mm512_srli_epi16(c, 4), two);
    wv[4 * u + 3] = _mm512_and_si512(_mm512_srli_epi16(c, 6), two);
  }
}

// Q3_K: a block's 8 vectors of 3-bit quants (0..7) out of its 2 chunks of crumbs and its 3rd bits.
inline void three_bits512(const uint8_t* qb, __m512i wv[8]) {
  const __m512i b3 = _mm512_set1_epi8(0x04);
  two_bits512(qb, wv);
  for (int v = 0; v < 8; ++v) wv[v] = _mm512_mask_add_epi8(wv[v], _cvtu64_mask64(high_bits(qb, v, bits_at(Q3_K))), wv[v], b3);
}

// Whether 8- and 16-row tiles of the kinds with a minimum issue their rows' chains side by side (group_tile's SBS):
// on Intel's cores (the CPU's vendor, read once: a path picked by it depends on the CPU, never on a timing). A Zen 5
// (family 26 model 2, session 43, alternated in one process, gemm_ab.cpp of session 39) ran the 16-row halves
// 0.82-0.91x and 8-row tiles 0.95-1.04x against the two chains a row.
inline bool rows_side_by_side() { return disagg_cpu::intel_cores(); }

template <Kind KD, int R, bool SBS = false>
inline void group_tile(const Q16& w, const ActQ8& x, int64_t r0, int64_t g, float* y, int64_t ldy,
                       const float* bias, bool accumulate) {
  constexpr int64_t BB = Q16::block_bytes(KD);
  const int64_t NB = w.NB(), K = w.K;
  const uint8_t* qg = w.group_qs(g);
  const uint16_t* dg = w.d + g * w.d_blocks() * GROUP;
  const uint16_t* mg = has_min(KD) ? w.m + g * NB * GROUP : nullptr;
  const int8_t* sg =
      sub_scales(KD) || q2_mins(KD) ? reinterpret_cast<const int8_t*>(w.m) + g * NB * 2 * GROUP : nullptr;
  const uint8_t* kg = two_level(KD) ? reinterpret_cast<const uint8_t*>(w.m) + g * NB * 2 * GROUP : nullptr;
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i b5 = _mm512_set1_epi8(0x10);
  __m512i table = _mm512_setzero_si512();  // IQ4_NL: its values + 128 in each 128-bit lane
  if constexpr (KD == IQ4_NL)
    table = _mm512_xor_si512(
        _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES))), flip);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 dsup = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* qb = qg + b * BB;
    prefetch_block<BB>(qb + prefetch_blocks<KD, R>() * BB);
    __m512i wv[8];
    if constexpr (KD == Q8_0) {
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_xor_si512(_mm512_loadu_si512(qb + c * 64), flip);
    } else if constexpr (byte_quants(KD)) {  // an unpacked copy
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(qb + c * 64);
    } else if constexpr (KD == Q3_K) {
      three_bits512(qb, wv);
    } else if constexpr (KD == Q2_K) {
      two_bits512(qb, wv);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(qb + c * 64);
        wv[2 * c] = _mm512_and_si512(v, low4);
        wv[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      if constexpr (KD == Q6_K)
        six_bits512(qb, wv);
      else if constexpr (KD == IQ4_NL)
        for (int v = 0; v < 8; ++v) wv[v] = _mm512_shuffle_epi8(table, wv[v]);
      else if constexpr (has_high(KD))
        for (int v = 0; v < 8; ++v) wv[v] = _mm512_mask_add_epi8(wv[v], _cvtu64_mask64(high_bits(qb, v)), wv[v], b5);
    }
    if (scale_span(KD) == BLOCK || b % 8 == 0) {  // a super-block's d (and dmin) once for its 8 blocks
      const uint16_t* db = dg + d_entry(KD, b) * GROUP;
      dsup = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(db)));
      if constexpr (has_dmin(KD))
        dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(db + GROUP)));
    }
    __m512 dv = dsup, mv = _mm512_setzero_ps();
    if constexpr (two_level(KD)) {  // d * sc and dmin * mn (subtracted below): exact in fp32 (11 + 6 bits)
      const __m128i* k8 = reinterpret_cast<const __m128i*>(kg + b * 2 * GROUP);
      dv = _mm512_mul_ps(dsup, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(k8))));
      mv = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(k8 + 1))));
    } else if constexpr (has_min(KD)) {
      mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * GROUP)));
    }
    __m512i sa = _mm512_setzero_si512(), sb = _mm512_setzero_si512();  // Q6_K: the halves' sub-block scales
    __m512 mlo = _mm512_setzero_ps(), mhi = _mm512_setzero_ps();  // Q2_K: dmin * (mn_lo - mn_hi), dmin * mn_hi
    if constexpr (q2_mins(KD)) {  // each half's byte: the scale in the low nibble, the minimum in the high one
      const __m512i ka = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP)));
      const __m512i kb =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP + GROUP)));
      if constexpr (KD == Q2_K) {  // (U8_Q2K's bytes hold q times the scale already)
        sa = _mm512_and_si512(ka, _mm512_set1_epi32(0x0F));
        sb = _mm512_and_si512(kb, _mm512_set1_epi32(0x0F));
      }
      mhi = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(kb, 4)));  // dmin (mn_lo - mn_hi): exact
      const __m512i dmn = _mm512_sub_epi32(_mm512_srli_epi32(ka, 4), _mm512_srli_epi32(kb, 4));
      mlo = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(dmn));
    } else if constexpr (sub_scales(KD)) {
      sa = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP)));
      sb = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP + GROUP)));
    }
    // SBS (Intel's cores: rows_side_by_side()), 8- and 16-row tiles of the kinds with a minimum (Q4_1, Q5_1, Q4_K, Q5_K
    // and their unpacked copies): every row's integer sum one chain of 8 `vpdpbusd`, 8 rows' chains issued side by side
    // (a chunk at a time for those rows), instead of two chains a row joined by an add. The Emerald Rapids (family 6
    // model 207, session 42, one thread, alternated in one process, gemm_ab.cpp of session 39): Q4_1 1.10-1.12x, Q4_K
    // 1.10-1.17x, Q5_1 1.04-1.09x at 8 and 64 rows; at 16 rows (two halves of 8) Q4_1 1.06-1.14x, Q4_K 1.13-1.16x,
    // Q5_1 1.09-1.14x. Q4_0 and Q8_0 (no minimum) 0.95-1.0x so; all 16 rows at once 0.77-0.87x (their sums spill). The
    // integer sums are the same.
    constexpr bool side_by_side = SBS && (R == 8 || R == 16) && has_min(KD);
    [[maybe_unused]] __m512i sums[side_by_side ? R : 1];
    if constexpr (side_by_side) {
      for (int h = 0; h < R; h += 8) {
        for (int r = h; r < h + 8; ++r) sums[r] = _mm512_set1_epi32(u8_offset<KD>() * x.s[(r0 + r) * NB + b]);
        for (int c = 0; c < 8; ++c)
          for (int r = h; r < h + 8; ++r) {
            const int32_t* xi = reinterpret_cast<const int32_t*>(x.q + (r0 + r) * K + b * BLOCK);
            sums[r] = _mm512_dpbusd_epi32(sums[r], wv[c], _mm512_set1_epi32(xi[c]));
          }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int32_t* xi = reinterpret_cast<const int32_t*>(x.q + row * K + b * BLOCK);
      // the offset (Q8_0's and IQ4_NL's +128 u8 offset here: -128 s) is where the sum starts
      const int32_t s = x.s[row * NB + b];
      __m512i a;
      if constexpr (side_by_side) {
        a = sums[r];
      } else if constexpr (sub_scales(KD)) {  // per half: sum (q - 32) x (Q3_K: q - 4), times the half's scale; < 2^24
        const int32_t slo = x.slo[row * NB + b];
        __m512i lo = _mm512_set1_epi32(sub_offset<KD>() * slo), hi = _mm512_set1_epi32(sub_offset<KD>() * (s - slo));
        for (int c = 0; c < 4; ++c) {
          lo = _mm512_dpbusd_epi32(lo, wv[c], _mm512_set1_epi32(xi[c]));
          hi = _mm512_dpbusd_epi32(hi, wv[c + 4], _mm512_set1_epi32(xi[c + 4]));
        }
        a = _mm512_add_epi32(_mm512_mullo_epi32(lo, sa), _mm512_mullo_epi32(hi, sb));
      } else if constexpr (byte_quants(KD) && R > 1 && R <= 4) {  // (Q8_0 at 2-4 rows: one chain, see below)
        a = _mm512_set1_epi32(u8_offset<KD>() * s);
        for (int c = 0; c < 8; ++c) a = _mm512_dpbusd_epi32(a, wv[c], _mm512_set1_epi32(xi[c]));
      } else {
        // two chains of 4: a chain of 8 `vpdpbusd` (5 cycles each) a row and block held the scheduler with waiting
        // uops — an Emerald Rapids Xeon (family 6 model 207, two 512-bit ports: 6 G `vpdpbusd` a second) ran 2-64
        // rows at 0.25-0.45 of its peak; two chains 1.12-1.18x faster there at 8-64 rows and 1.08-1.13x at 4 (Q4_0 /
        // Q4_1 / Q4_K / Q5_1; Q8_0 1.14-1.20x at 8-64), four no faster, Q8_0 at 2-4 rows (its 512-byte blocks read
        // at the memory's pace) 0.96-0.98x (session 40, alternated in one process; gemm_ab.txt). The integer sum is
        // the same.
        a = _mm512_set1_epi32(u8_offset<KD>() * s);
        __m512i a1 = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
          a = _mm512_dpbusd_epi32(a, wv[c], _mm512_set1_epi32(xi[c]));
          a1 = _mm512_dpbusd_epi32(a1, wv[c + 1], _mm512_set1_epi32(xi[c + 1]));
        }
        a = _mm512_add_epi32(a, a1);
      }
      const float dx = x.dx[row * NB + b];
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dv, _mm512_set1_ps(dx)), acc[r]);
      if constexpr (two_level(KD))  // - (dmin mn) dxs in one rounding: as fmadd with -(dmin mn), bit for bit
        acc[r] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(x.dxs[row * NB + b]), acc[r]);
      else if constexpr (q2_mins(KD)) {  // - (dmin mn) dx s per half: - dmin mn_hi dx s - dmin (mn_lo - mn_hi) dx slo
        acc[r] = _mm512_fnmadd_ps(mhi, _mm512_set1_ps(x.dxs[row * NB + b]), acc[r]);
        acc[r] = _mm512_fnmadd_ps(mlo, _mm512_set1_ps(x.dxlo[row * NB + b]), acc[r]);
      }
      else if constexpr (has_min(KD))
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.dxs[row * NB + b]), acc[r]);
    }
  }
  const int64_t n0 = g * GROUP;
  for (int r = 0; r < R; ++r) {
    float* yr = y + (r0 + r) * ldy;
    if (n0 + GROUP <= w.N) {
      __m512 v = acc[r];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
      if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(yr + n0));
      _mm512_storeu_ps(yr + n0, v);
    } else {
      alignas(64) float vals[GROUP];
      _mm512_store_ps(vals, acc[r]);
      store_group(vals, yr, bias, n0, w.N, accumulate);
    }
  }
}
constexpr int TILE_ROWS = 8;

// One Q5 / Q6_K / Q3_K / Q2_K / IQ4_NL block -> a byte a weight in Q8's layout: Q5_0's as the Q8_0 block of the same
// values (q - 16, signed), IQ4_NL's likewise (its table's values), Q5_1's as U8_MIN, Q5_K's as U8_K5 and Q6_K's as
// U8_Q6K (q, unsigned); Q3_K's as U8_Q6K too (q + 28: (q - 4) + 32); Q2_K's as U8_Q2K: q times its half block's 4-bit
// scale (<= 45), so that a row's integer sum needs no multiply by the scales (mb: the block's 32 bytes of m).
template <Kind KD>
inline void unpack_block(const uint8_t* qb, uint8_t* out, const uint8_t* mb) {
  if constexpr (KD == Q2_K) {
    __m512i wv[8];
    two_bits512(qb, wv);
    const __m512i one = _mm512_set1_epi8(1), two = _mm512_set1_epi8(2);
    for (int h = 0; h < 2; ++h) {  // output j's scale in each of its 4 bytes: q sc = (q & 1) sc + (q & 2) sc
      const __m512i k32 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mb + 16 * h)));
      const __m512i sc32 = _mm512_and_si512(k32, _mm512_set1_epi32(0x0F));
      const __m512i sc = _mm512_mullo_epi32(sc32, _mm512_set1_epi32(0x01010101));
      for (int v = 4 * h; v < 4 * h + 4; ++v) {
        const __m512i p = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(wv[v], one), sc);
        _mm512_storeu_si512(out + v * 64,
                            _mm512_mask_add_epi8(p, _mm512_test_epi8_mask(wv[v], two), p, _mm512_add_epi8(sc, sc)));
      }
    }
    return;
  }
  (void)mb;
  if constexpr (KD == Q3_K) {
    __m512i wv[8];
    three_bits512(qb, wv);
    for (int v = 0; v < 8; ++v) _mm512_storeu_si512(out + v * 64, _mm512_add_epi8(wv[v], _mm512_set1_epi8(28)));
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F), b5 = _mm512_set1_epi8(0x10);
  __m512i table = _mm512_setzero_si512();  // IQ4_NL: its (signed) values in each 128-bit lane
  if constexpr (KD == IQ4_NL)
    table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES)));
  __m512i wv[8];
  for (int v = 0; v < 8; ++v) {
    const __m512i raw = _mm512_loadu_si512(qb + (v / 2) * 64);
    wv[v] = _mm512_and_si512(v % 2 ? _mm512_srli_epi16(raw, 4) : raw, low4);
    if constexpr (KD == IQ4_NL)
      wv[v] = _mm512_shuffle_epi8(table, wv[v]);
    else if constexpr (KD != Q6_K)
      wv[v] = _mm512_mask_add_epi8(wv[v], _cvtu64_mask64(high_bits(qb, v)), wv[v], b5);
  }
  if constexpr (KD == Q6_K) six_bits512(qb, wv);
  for (int v = 0; v < 8; ++v) _mm512_storeu_si512(out + v * 64, KD == Q5_0 ? _mm512_sub_epi8(wv[v], b5) : wv[v]);
}

#elif defined(DISAGG_I8_AVX2)
// Eight outputs (half h of the group) at a time: 16 ymm registers do not hold a whole group's block.

// Q5: half h's 32 bits of word v of the 5th bits (qb: the block's start + h * 32, as half_tile reads it; Q3_K's 3rd
// bits: at bits_at(Q3_K)).
inline uint32_t half_bits(const uint8_t* qb, int v, int h, int64_t at = bits_at(Q5_0)) {
  uint32_t bits;
  std::memcpy(&bits, qb - 32 * h + at + 8 * v + 4 * h, sizeof bits);
  return bits;
}

// Q5: 32 bits (a half's share of a word of 5th bits) -> 32 bytes, 0x10 where the bit is set (Q3_K: `value` 0x04).
inline __m256i fifth_bits(uint32_t bits, char value = 0x10) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i <- byte i / 8 of `bits` (each 128-bit lane holds all 4)
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));  // byte i: 1 << (i % 8)
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(value));
}

// Tiles of more than one row take the plain nibbles (Q4_0 / Q4_1 / Q4_K) out once a block for all their rows instead
// of once a row (the AVX2-only Zen 3 of 2026-12-07, family 25 model 1, one thread, alternated in one process: Q4_1 /
// Q4_K 1.11-1.18x, Q4_0 0.99-1.05x at 4-64 rows; BENCHMARKS.md). The integer sums and their float order are as before,
// so a row computes the same alone and in a batch. One row keeps the loop that takes them out as it reads.
template <Kind KD, int R>
constexpr bool hoisted_nibbles() { return R > 1 && (KD == Q4_0 || KD == Q4_1 || KD == Q4_K); }

template <Kind KD, int R>
inline void half_tile(const Q16& w, const ActQ8& x, int64_t r0, int64_t g, int h, __m256 acc[R]) {
  constexpr int64_t BB = Q16::block_bytes(KD);
  const int64_t NB = w.NB(), K = w.K;
  const uint8_t* qg = w.group_qs(g) + h * 32;  // (the 5th bits: qb - h * 32, see half_bits)
  const uint16_t* dg = w.d + g * w.d_blocks() * GROUP + h * 8;
  const uint16_t* mg = has_min(KD) ? w.m + g * NB * GROUP + h * 8 : nullptr;
  const int8_t* sg = sub_scales(KD) ? reinterpret_cast<const int8_t*>(w.m) + g * NB * 2 * GROUP + h * 8 : nullptr;
  const uint8_t* kg = two_level(KD) ? reinterpret_cast<const uint8_t*>(w.m) + g * NB * 2 * GROUP + h * 8 : nullptr;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* qb = qg + b * BB;
    if (h == 0) prefetch_block<BB>(qb + prefetch_blocks<KD, R>() * BB);  // the lines of both halves
    const uint16_t* db = dg + d_entry(KD, b) * GROUP;
    __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db)));
    __m256 mv = _mm256_setzero_ps();
    if constexpr (two_level(KD)) {  // (d * sc, -(dmin * mn)), as on AVX-512
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db + GROUP)));
      const uint8_t* k8 = kg + b * 2 * GROUP;
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k8));
      dv = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)));
      mv = _mm256_sub_ps(_mm256_setzero_ps(),
                         _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k8 + GROUP))))));
    } else if constexpr (has_min(KD)) {
      mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg + b * GROUP)));
    }
    __m256i w5[8];  // the block unpacked once for all rows: Q5 / Q6_K / Q3_K / Q2_K quants, IQ4_NL values, nibbles
    if constexpr (KD == IQ4_NL) {
      const __m256i table =
          _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_NL_VALUES)));
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 64));
        w5[2 * c] = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
        w5[2 * c + 1] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      }
    } else if constexpr (KD == Q6_K) {  // the crumbs of this half (see six_bits512)
      const __m256i top = _mm256_set1_epi8(0x30);
      for (int u = 0; u < 2; ++u) {
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 256 + 64 * u));
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + (2 * u) * 64));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + (2 * u + 1) * 64));
        w5[4 * u] = _mm256_or_si256(_mm256_and_si256(v0, low4), _mm256_and_si256(_mm256_slli_epi16(hv, 4), top));
        w5[4 * u + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
                                        _mm256_and_si256(_mm256_slli_epi16(hv, 2), top));
        w5[4 * u + 2] = _mm256_or_si256(_mm256_and_si256(v1, low4), _mm256_and_si256(hv, top));
        w5[4 * u + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4),
                                        _mm256_and_si256(_mm256_srli_epi16(hv, 2), top));
      }
    } else if constexpr (KD == Q3_K || KD == Q2_K) {  // this half's crumbs (and Q3_K's 3rd bits: three_bits512)
      const __m256i two = _mm256_set1_epi8(0x03);
      for (int u = 0; u < 2; ++u) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 64 * u));
        for (int t = 0; t < 4; ++t) {
          w5[4 * u + t] = _mm256_and_si256(_mm256_srli_epi16(c, 2 * t), two);
          if constexpr (KD == Q3_K)
            w5[4 * u + t] = _mm256_or_si256(w5[4 * u + t], fifth_bits(half_bits(qb, 4 * u + t, h, bits_at(Q3_K)), 0x04));
        }
      }
    } else if constexpr (hoisted_nibbles<KD, R>()) {
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 64));
        w5[2 * c] = _mm256_and_si256(v, low4);
        w5[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
    } else if constexpr (has_high(KD)) {
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 64));
        w5[2 * c] = _mm256_or_si256(_mm256_and_si256(v, low4), fifth_bits(half_bits(qb, 2 * c, h)));
        w5[2 * c + 1] =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), fifth_bits(half_bits(qb, 2 * c + 1, h)));
      }
    }
    __m256i wa[8];  // Q8_0 / IQ4_NL: |w| once for all rows (the sign trick puts w's sign on each row's x)
    if constexpr (KD == Q8_0 || KD == IQ4_NL)
      for (int c = 0; c < 8; ++c)
        wa[c] = _mm256_abs_epi8(KD == Q8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 64)) : w5[c]);
    __m256i sa = _mm256_setzero_si256(), sb = _mm256_setzero_si256();  // Q6_K / Q3_K: the halves' sub-block scales
    __m256 mlo = _mm256_setzero_ps(), mhi = _mm256_setzero_ps();  // Q2_K: dmin * (mn_lo - mn_hi), dmin * mn_hi
    if constexpr (KD == Q2_K) {  // each half's byte: the scale in the low nibble, the minimum in the high one
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db + GROUP)));
      const __m256i ka = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP)));
      const __m256i kb =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP + GROUP)));
      sa = _mm256_and_si256(ka, _mm256_set1_epi32(0x0F));
      sb = _mm256_and_si256(kb, _mm256_set1_epi32(0x0F));
      mhi = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(kb, 4)));  // (as on AVX-512)
      const __m256i dmn = _mm256_sub_epi32(_mm256_srli_epi32(ka, 4), _mm256_srli_epi32(kb, 4));
      mlo = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(dmn));
    } else if constexpr (sub_scales(KD)) {
      sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP)));
      sb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg + b * 2 * GROUP + GROUP)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int32_t* xi = reinterpret_cast<const int32_t*>(x.q + row * K + b * BLOCK);
      __m256i a;
      if constexpr (KD == Q8_0 || KD == IQ4_NL) {
        // signed weights by the sign trick: |w| (u8, <= 128) x (x with w's sign; |x| <= 127): w x, pairs <= 32,512
        a = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i wq = KD == Q8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 64)) : w5[c];
          const __m256i p = _mm256_maddubs_epi16(wa[c], _mm256_sign_epi8(_mm256_set1_epi32(xi[c]), wq));
          a = _mm256_add_epi32(a, _mm256_madd_epi16(p, ones));
        }
      } else if constexpr (sub_scales(KD)) {
        // per half: 2 x 2 products of <= 63 * 127 per 16-bit lane (at most 32,004) before widening; then - 32 x's sum
        // (Q3_K: - 4), times the half's scale (|result| < 2^24)
        const int32_t s = x.s[row * NB + b], slo = x.slo[row * NB + b];
        __m256i half[2];
        for (int p = 0; p < 2; ++p) {
          const __m256i m16 = _mm256_add_epi16(_mm256_maddubs_epi16(w5[4 * p], _mm256_set1_epi32(xi[4 * p])),
                                               _mm256_maddubs_epi16(w5[4 * p + 1], _mm256_set1_epi32(xi[4 * p + 1])));
          const __m256i n16 = _mm256_add_epi16(_mm256_maddubs_epi16(w5[4 * p + 2], _mm256_set1_epi32(xi[4 * p + 2])),
                                               _mm256_maddubs_epi16(w5[4 * p + 3], _mm256_set1_epi32(xi[4 * p + 3])));
          half[p] = _mm256_add_epi32(_mm256_madd_epi16(m16, ones), _mm256_madd_epi16(n16, ones));
        }
        half[0] = _mm256_add_epi32(half[0], _mm256_set1_epi32(sub_offset<KD>() * slo));
        half[1] = _mm256_add_epi32(half[1], _mm256_set1_epi32(sub_offset<KD>() * (s - slo)));
        a = _mm256_add_epi32(_mm256_mullo_epi32(half[0], sa), _mm256_mullo_epi32(half[1], sb));
      } else if constexpr (has_high(KD)) {
        // 2 products of <= 31 * 127 per 16-bit lane pair (at most 15,748) before each widening: no saturation
        a = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w5[2 * c], _mm256_set1_epi32(xi[2 * c])),
                                             _mm256_maddubs_epi16(w5[2 * c + 1], _mm256_set1_epi32(xi[2 * c + 1])));
          a = _mm256_add_epi32(a, _mm256_madd_epi16(p, ones));
        }
      } else if constexpr (hoisted_nibbles<KD, R>()) {
        // 8 products of <= 15 * 127 per 16-bit lane pair: at most 30,480, no saturation
        __m256i p = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w5[c], _mm256_set1_epi32(xi[c])));
        a = _mm256_madd_epi16(p, ones);
      } else {
        // (as above; one row: its nibbles taken out as the block is read)
        __m256i p = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 64));
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xi[2 * c])));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xi[2 * c + 1])));
        }
        a = _mm256_madd_epi16(p, ones);
      }
      if constexpr (offset<KD>() != 0) a = _mm256_add_epi32(a, _mm256_set1_epi32(offset<KD>() * x.s[row * NB + b]));
      const float dx = x.dx[row * NB + b];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(dv, _mm256_set1_ps(dx)), acc[r]);
      if constexpr (has_min(KD)) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(x.dxs[row * NB + b]), acc[r]);
      if constexpr (KD == Q2_K) {  // - (dmin mn) dx s per half, as on AVX-512
        acc[r] = _mm256_fnmadd_ps(mhi, _mm256_set1_ps(x.dxs[row * NB + b]), acc[r]);
        acc[r] = _mm256_fnmadd_ps(mlo, _mm256_set1_ps(x.dxlo[row * NB + b]), acc[r]);
      }
    }
  }
}

// Q3_K over many rows on AVX2: a block as the Q6_K block of the same values (q + 28, the same scales), which the Q6_K
// kernel reads (extracting the 3rd bits per tile of 4 rows made Q3_K's GEMMs at 64-256 rows ~0.83x of its Q6_K form's).
template <Kind KD>
inline void unpack_block(const uint8_t* qb, uint8_t* out, const uint8_t*) {
  static_assert(KD == Q3_K, "AVX2 unpacks Q3_K only");
  const __m256i two = _mm256_set1_epi8(0x03), low4 = _mm256_set1_epi8(0x0F), offset = _mm256_set1_epi8(28);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* qh = qb + 32 * h;
    __m256i q[8];
    for (int u = 0; u < 2; ++u) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 64 * u));
      for (int t = 0; t < 4; ++t)
        q[4 * u + t] = _mm256_add_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 2 * t), two),
                                                       fifth_bits(half_bits(qh, 4 * u + t, h, bits_at(Q3_K)), 0x04)),
                                       offset);
    }
    for (int c = 0; c < 4; ++c)  // the nibbles: vector 2c low, 2c + 1 high (16-bit shifts of masked bytes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * c + 32 * h),
                          _mm256_or_si256(_mm256_and_si256(q[2 * c], low4),
                                          _mm256_slli_epi16(_mm256_and_si256(q[2 * c + 1], low4), 4)));
    for (int u = 0; u < 2; ++u) {  // the top two bits of vector 4u + t at bits 2t
      __m256i crumbs = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t)
        crumbs = _mm256_or_si256(
            crumbs, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(q[4 * u + t], 4), two), 2 * t));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 256 + 64 * u + 32 * h), crumbs);
    }
  }
}

template <Kind KD, int R>
inline void group_tile(const Q16& w, const ActQ8& x, int64_t r0, int64_t g, float* y, int64_t ldy,
                       const float* bias, bool accumulate) {
  alignas(32) float vals[R][GROUP];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    half_tile<KD, R>(w, x, r0, g, h, acc);
    for (int r = 0; r < R; ++r) _mm256_store_ps(vals[r] + h * 8, acc[r]);
  }
  for (int r = 0; r < R; ++r) store_group(vals[r], y + (r0 + r) * ldy, bias, g * GROUP, w.N, accumulate);
}
constexpr int TILE_ROWS = 4;

#else
template <Kind KD, int R>
inline void group_tile(const Q16& w, const ActQ8& x, int64_t r0, int64_t g, float* y, int64_t ldy,
                       const float* bias, bool accumulate) {
  constexpr int64_t BB = Q16::block_bytes(KD);
  const int64_t NB = w.NB(), K = w.K;
  float vals[R][GROUP] = {};
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* qb = w.group_qs(g) + b * BB;
    const int8_t* sc = sub_scales(KD) ? reinterpret_cast<const int8_t*>(w.m) + (g * NB + b) * 2 * GROUP : nullptr;
    for (int64_t j = 0; j < GROUP; ++j) {
      const int64_t di = (g * w.d_blocks() + d_entry(KD, b)) * GROUP + j;
      float d = fp16_to_float(w.d[di]), mn = 0.0f;
      float mlo = 0.0f, mhi = 0.0f;  // Q2_K: the halves' dmin * mn
      if constexpr (two_level(KD)) {
        const uint8_t* k8 = reinterpret_cast<const uint8_t*>(w.m) + (g * NB + b) * 2 * GROUP;
        mn = -(fp16_to_float(w.d[di + GROUP]) * static_cast<float>(k8[GROUP + j]));
        d *= static_cast<float>(k8[j]);
      } else if constexpr (KD == Q2_K) {
        const uint8_t* k8 = reinterpret_cast<const uint8_t*>(w.m) + (g * NB + b) * 2 * GROUP;
        mlo = fp16_to_float(w.d[di + GROUP]) * static_cast<float>(k8[j] >> 4);
        mhi = fp16_to_float(w.d[di + GROUP]) * static_cast<float>(k8[GROUP + j] >> 4);
      } else if constexpr (has_min(KD)) {
        mn = fp16_to_float(w.m[(g * NB + b) * GROUP + j]);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xq = x.q + row * K + b * BLOCK;
        int32_t dot = 0;
        if constexpr (KD == Q8_0) {
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 4; ++i) dot += static_cast<int8_t>(qb[c * 64 + j * 4 + i]) * xq[4 * c + i];
        } else {
          int32_t halves[2] = {0, 0};  // Q6_K / Q3_K: the sums of (q - 32 or 4) x over each half, times its scale
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const int jb = static_cast<int>(j * 4 + i);
              int32_t lo = quant_at(KD, qb, 2 * c, jb), hi = quant_at(KD, qb, 2 * c + 1, jb);
              if constexpr (KD == IQ4_NL) lo = IQ4_NL_VALUES[lo], hi = IQ4_NL_VALUES[hi];
              if constexpr (sub_scales(KD))
                halves[c / 2] += (lo + sub_offset<KD>()) * xq[8 * c + i] + (hi + sub_offset<KD>()) * xq[8 * c + 4 + i];
              else
                dot += lo * xq[8 * c + i] + hi * xq[8 * c + 4 + i];
            }
          if constexpr (KD == Q2_K)
            dot = halves[0] * (sc[j] & 0x0F) + halves[1] * (sc[GROUP + j] & 0x0F);
          else if constexpr (sub_scales(KD))
            dot = halves[0] * sc[j] + halves[1] * sc[GROUP + j];
        }
        dot += offset<KD>() * x.s[row * NB + b];
        const float dx = x.dx[row * NB + b];
        vals[r][j] += static_cast<float>(dot) * (d * dx);
        if constexpr (has_min(KD)) vals[r][j] += mn * x.dxs[row * NB + b];
        if constexpr (KD == Q2_K) {
          const float lo = x.dxlo[row * NB + b];
          vals[r][j] -= mlo * lo + mhi * (x.dxs[row * NB + b] - lo);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store_group(vals[r], y + (r0 + r) * ldy, bias, g * GROUP, w.N, accumulate);
}
constexpr int TILE_ROWS = 4;
#endif

// Decode-sized calls (up to WIDE_MAX_ROWS rows) take their rows 16 at a time first, and 9-15 rows left as one tile:
// each block of the weight as stored is loaded and unpacked once for up to 16 rows, not twice (16 accumulators + 8
// weight vectors of the 32 registers). One thread, SmolLM2's shapes, against 8-row tiles and the rest (2026-12-05,
// AVX-512 Zen 4): at 16 rows Q5_0 1.03-1.08x, Q6_K 1.08-1.11x, Q4_K 1.00-1.04x, the 49,152-row Q8_0 lm_head (28 MB
// from L3 / DRAM) 0.9-1.2x, noisy, a Q8_0 weight in cache 0.96-1.00x; at 9 rows 1.05-1.15x, 12 rows 1.04-1.11x, 15
// rows 1.03-1.09x (a Q8_0 weight in cache 0.97-0.99x), the lm_head 1.0-1.5x; SmolLM2 Q4_K_M's batch-16 step 1.04x /
// 1.07x at 1 / 2 threads (BENCHMARKS.md). Not past it: the unpacked copy (groups_unpacked) ran 0.95-0.98x with
// 16-row tiles (the copy is in L1), and the other kinds at 256 rows 0.98-1.07x across runs, no clear gain.
constexpr int WIDE_ROWS = 16;
constexpr int64_t WIDE_MAX_ROWS = 2 * WIDE_ROWS;

// Groups [g0, g1) of every row of x: the caller splits groups over threads.
template <Kind KD>
inline void groups_kind(const Q16& w, const ActQ8& x, int64_t R, int64_t g0, int64_t g1, float* y, int64_t ldy,
                        const float* bias, bool accumulate);

#if defined(DISAGG_I8_AVX512) || defined(DISAGG_I8_AVX2)
// The kind a group of KD is unpacked into (unpacks(KD)): AVX-512 a byte a weight, AVX2 Q3_K's Q6_K form.
template <Kind KD>
constexpr Kind unpacked_kind() {
#if defined(DISAGG_I8_AVX512)
  return KD == Q5_0 || KD == IQ4_NL ? Q8_0
         : KD == Q5_1               ? U8_MIN
         : KD == Q5_K               ? U8_K5
         : KD == Q2_K               ? U8_Q2K
                                    : U8_Q6K;
#else
  return Q6_K;
#endif
}

// Q5 / Q5_K / Q6_K / Q3_K / Q2_K / IQ4_NL over many rows on AVX-512: each group unpacked once into a byte a weight
// (Q5_0 and IQ4_NL: the Q8_0 blocks of the same values; Q5_1: U8_MIN; Q5_K: U8_K5; Q6_K and Q3_K: U8_Q6K; Q2_K:
// U8_Q2K), and every tile of rows run on that copy (in L1 / L2) by that kind's kernel, instead of unpacking each block
// again per tile (at 256 rows that cost Q5_0 ~12 % against Q8_0 on the AVX-512 Zen 4, IQ4_NL's lookup 14 % on a 7B
// FFN-down; Q6_K ran at 0.77x of Q8_0's time without the copy, 0.84-0.88x with).
// On AVX2 only Q3_K (into its Q6_K form): its Q8_0 kernel (the sign trick) costs more per row than Q5_0's unsigned
// products there (the AVX2 build's GEMMs at 9 rows 0.87x, at 64 rows 0.96x of Q8_0's with the copy).
// More rows than this: unpack first. AVX-512: past the decode-sized calls, which 16-row tiles take (Q5_0 / Q6_K at 24
// and 32 rows 1.03-1.08x the copy's rate, 2026-12-05); AVX2: two tiles.
#if defined(DISAGG_I8_AVX512)
constexpr int64_t UNPACK_ROWS = WIDE_MAX_ROWS;
#else
constexpr int64_t UNPACK_ROWS = 2 * TILE_ROWS;
#endif

template <Kind KD>
inline void groups_unpacked(const Q16& w, const ActQ8& x, int64_t R, int64_t g0, int64_t g1, float* y,
                               int64_t ldy, const float* bias, bool accumulate) {
  constexpr Kind UK = unpacked_kind<KD>();
  thread_local std::vector<uint8_t> buf;  // (the step's parallel region: grows once to the widest K, never throws
                                          // in practice: 16 KB per 1,000 columns)
  const int64_t NB = w.NB(), BB = Q16::block_bytes(KD), XB = Q16::block_bytes(UK);
  buf.resize(static_cast<size_t>(NB * XB));
  Q16 wx = w;
  wx.kind = UK;
  wx.qs = buf.data();
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* qg = w.group_qs(g);
    const uint8_t* mg = q2_mins(KD) ? reinterpret_cast<const uint8_t*>(w.m) + g * NB * 2 * GROUP : nullptr;
    for (int64_t b = 0; b < NB; ++b)
      unpack_block<KD>(qg + b * BB, buf.data() + b * XB, mg != nullptr ? mg + b * 2 * GROUP : nullptr);
    wx.first_group = g;
    groups_kind<UK>(wx, x, R, g, g + 1, y, ldy, bias, accumulate);
  }
}
#endif

// AVX-512's decode-sized calls in 16-row tiles (WIDE_ROWS), for the kinds stored (the unpacked copies' kinds run
// past WIDE_MAX_ROWS only).
template <Kind KD>
constexpr bool wide_tiles() {
#if defined(DISAGG_I8_AVX512)
  return KD < U8_MIN;
#else
  return false;
#endif
}

// A tile of R rows from r0: group_tile<KD, R>, its rows side by side where rows_side_by_side() picks it.
template <Kind KD, int R>
inline void tile(const Q16& w, const ActQ8& x, int64_t r0, int64_t g, float* y, int64_t ldy, const float* bias,
                 bool accumulate) {
#if defined(DISAGG_I8_AVX512)
  if constexpr (has_min(KD) && (R == 8 || R == 16))
    if (rows_side_by_side()) return group_tile<KD, R, true>(w, x, r0, g, y, ldy, bias, accumulate);
#endif
  group_tile<KD, R>(w, x, r0, g, y, ldy, bias, accumulate);
}

// The n rows from r0 as one tile, n in 1 .. sizeof...(N): tile<KD, n>.
template <Kind KD, int... N>
inline void last_tile(int64_t n, std::integer_sequence<int, N...>, const Q16& w, const ActQ8& x, int64_t r0, int64_t g,
                      float* y, int64_t ldy, const float* bias, bool accumulate) {
  static_cast<void>(((n == N + 1 && (tile<KD, N + 1>(w, x, r0, g, y, ldy, bias, accumulate), true)) || ...));
}

template <Kind KD>
inline void groups_kind(const Q16& w, const ActQ8& x, int64_t R, int64_t g0, int64_t g1, float* y, int64_t ldy,
                        const float* bias, bool accumulate) {
#if defined(DISAGG_I8_AVX512) || defined(DISAGG_I8_AVX2)
  if constexpr (unpacks(KD)) {
    if (R > UNPACK_ROWS) return groups_unpacked<KD>(w, x, R, g0, g1, y, ldy, bias, accumulate);
  }
#endif
  // the rows left after the full tiles go as one tile: up to 15 of them in AVX-512's decode-sized calls, else fewer
  // than TILE_ROWS
  constexpr int MOST_LEFT = wide_tiles<KD>() ? WIDE_ROWS - 1 : TILE_ROWS - 1;
  for (int64_t g = g0; g < g1; ++g) {
    int64_t r = 0, left = TILE_ROWS - 1;
    if constexpr (wide_tiles<KD>())
      if (R <= WIDE_MAX_ROWS) {
        for (; r + WIDE_ROWS <= R; r += WIDE_ROWS) tile<KD, WIDE_ROWS>(w, x, r, g, y, ldy, bias, accumulate);
        left = WIDE_ROWS - 1;
      }
    for (; R - r > left; r += TILE_ROWS) tile<KD, TILE_ROWS>(w, x, r, g, y, ldy, bias, accumulate);
    if (r < R)
      last_tile<KD>(R - r, std::make_integer_sequence<int, MOST_LEFT>{}, w, x, r, g, y, ldy, bias, accumulate);
  }
}

inline void gemm_groups(const Q16& w, const ActQ8& x, int64_t R, int64_t g0, int64_t g1, float* y, int64_t ldy,
                        const float* bias, bool accumulate = false) {
  switch (w.kind) {
    case Q8_0: groups_kind<Q8_0>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q4_0: groups_kind<Q4_0>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q4_1: groups_kind<Q4_1>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q5_0: groups_kind<Q5_0>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q5_1: groups_kind<Q5_1>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q6_K: groups_kind<Q6_K>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q4_K: groups_kind<Q4_K>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q5_K: groups_kind<Q5_K>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case IQ4_NL: groups_kind<IQ4_NL>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q3_K: groups_kind<Q3_K>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case Q2_K: groups_kind<Q2_K>(w, x, R, g0, g1, y, ldy, bias, accumulate); break;
    case U8_MIN:
    case U8_Q2K:
    case U8_K5:
    case U8_Q6K: break;  // never stored (groups_unpacked's copies)
  }
}

// The share [begin, end) of `total` items that thread `t` of `n` takes.
inline std::pair<int64_t, int64_t> share(int64_t total, int t, int n) {
  const int64_t per = total / n, extra = total % n;
  const int64_t begin = t * per + std::min<int64_t>(t, extra);
  return {begin, begin + per + (t < extra ? 1 : 0)};
}

}  // namespace disagg_q
