// Causal prefill attention over paged K / V (CPU, AVX-512): a chunk of L query tokens at positions
// first .. first + L - 1 of one sequence, each attending to the sequence's keys 0 .. its own position.
//
//   q          [L, Hq, D]   fp32 or bf16 (the pool's dtype), unscaled
//   pool       one layer's pages (strides as paged_decode_attention takes them)
//   page_table [M] int64    the sequence's pages, in token order (M * page_size >= first + L)
//   returns    [L, Hq, D]   q's dtype
//
// PyTorch's CPU flash SDPA runs these at ~19 GMAC/s of useful work on a Zen 4 core (it computes the masked
// half too); here, per KV head, the keys are converted once to fp32 and transposed in blocks of 16 (so a
// block's 16 scores of a query row are 16 lanes of one accumulator: no horizontal sums) and the values to
// fp32 rows; then jobs of (KV head, 16 query positions) (their G query heads each, 4 rows at a time sharing
// every key and value load) walk the key blocks up to the diagonal only, with an online softmax in fp32.
// D must be a multiple of 16 (<= 256); prefill_attention_supported() says whether this build has the kernel.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t KB = 16;    // keys per block (the lanes of a score vector)
constexpr int64_t QB = 16;    // query positions per job
constexpr int RB = 4;         // query rows sharing each load
constexpr int64_t DMAX = 256;

template <typename T>
inline float at_f(const T* p) {
  return static_cast<float>(*p);
}

// K of head h, keys [0, S), as fp32 blocks [S / 16][D][16] (the last block padded with zeros), and V as
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

// R query rows (fp32, scaled) at causal limits lim[r] (the last key each may see) over key blocks up to
// the largest limit; out rows in fp32. NV = D / 16 (0: read from D, slower).
template <int R, int NV>
void rows_job(const float* const* qr, const int64_t* lim, const float* kt, const float* vf, int64_t D, float* const* out) {
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
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float p[R][KB];
  for (int64_t b = 0; b * KB <= last; ++b) {
    const float* blk = kt + b * D * KB;
    __m512 s0[R], s1[R];  // even and odd d: two chains a row hide the FMA latency
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 2) {
      const __m512 k0 = _mm512_loadu_ps(blk + d * KB), k1 = _mm512_loadu_ps(blk + (d + 1) * KB);
      for (int r = 0; r < R; ++r) {
        s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), k0, s0[r]);
        s1[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d + 1]), k1, s1[r]);
      }
    }
    const __m512i keys = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(b * KB)));
    for (int r = 0; r < R; ++r) {  // keys past the row's limit are -inf; the online softmax's update
      const __mmask16 ok = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(static_cast<int32_t>(lim[r])));
      const __m512 sv = _mm512_mask_blend_ps(ok, ninf, _mm512_add_ps(s0[r], s1[r]));
      const float mn = std::max(m[r], _mm512_reduce_max_ps(sv));
      const float c = std::exp(m[r] - mn);
      const __m512 e = _mm512_maskz_mov_ps(ok, disagg_attn::exp512(_mm512_sub_ps(sv, _mm512_set1_ps(mn))));
      l[r] = l[r] * c + _mm512_reduce_add_ps(e);
      m[r] = mn;
      _mm512_store_ps(p[r], e);
      const __m512 cv = _mm512_set1_ps(c);
      for (int64_t v = 0; v < nv; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], cv);
    }
    const int64_t n = std::min<int64_t>(KB, last + 1 - b * KB);
    for (int64_t t = 0; t < n; ++t) {
      const float* vrow = vf + (b * KB + t) * D;
      for (int64_t v = 0; v < nv; ++v) {
        const __m512 vv = _mm512_loadu_ps(vrow + v * 16);
        for (int r = 0; r < R; ++r) acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][t]), vv, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(out[r] + v * 16, _mm512_mul_ps(acc[r][v], inv));
  }
}

template <int NV>
void all_rows(int64_t rows, const float* const* qr, const int64_t* lim, const float* kt, const float* vf, int64_t D,
              float* const* out) {
  int64_t r = 0;
  for (; r + RB <= rows; r += RB) rows_job<RB, NV>(qr + r, lim + r, kt, vf, D, out + r);
  for (; r < rows; ++r) rows_job<1, NV>(qr + r, lim + r, kt, vf, D, out + r);
}

template <typename T>
void prefill_kernel(const T* q, const T* pool, const int64_t* table, T* out, int64_t L, int64_t first, int64_t Hq,
                    int64_t Hkv, int64_t D, int64_t P, int64_t page_stride, int64_t head_stride, int64_t kv_stride,
                    int64_t token_stride, float scale) {
  const int64_t G = Hq / Hkv, S = first + L, nb = (S + KB - 1) / KB;
  std::vector<float> kt(Hkv * nb * D * KB), vf(Hkv * nb * KB * D);
  at::parallel_for(0, Hkv * nb, 4, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t h = j / nb, b = j % nb;
      convert_head(pool, table, h, S, D, P, page_stride, head_stride, kv_stride, token_stride,
                   kt.data() + h * nb * D * KB, vf.data() + h * nb * KB * D, b, b + 1);
    }
  });
  const int64_t qblocks = (L + QB - 1) / QB;
  // query blocks in the order 0, last, 1, last - 1, ...: a causal block's cost grows with its position, so
  // any contiguous share of the jobs (at::parallel_for's split) holds as much work as another
  at::parallel_for(0, Hkv * qblocks, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> qf(QB * G * D), of(QB * G * D);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t h = j % Hkv, k = j / Hkv, qb = k % 2 == 0 ? k / 2 : qblocks - 1 - k / 2;
      const int64_t i0 = qb * QB, n = std::min(QB, L - i0), rows = n * G;
      std::vector<const float*> qr(rows);
      std::vector<float*> orow(rows);
      std::vector<int64_t> lim(rows);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const T* src = q + ((i0 + i) * Hq + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qf[r * D + d] = at_f(src + d) * scale;
          qr[r] = qf.data() + r * D;
          orow[r] = of.data() + r * D;
          lim[r] = first + i0 + i;
        }
      const float* kh = kt.data() + h * nb * D * KB;
      const float* vh = vf.data() + h * nb * KB * D;
      const auto run = D == 64 ? all_rows<4> : (D == 128 ? all_rows<8> : all_rows<0>);
      run(rows, qr.data(), lim.data(), kh, vh, D, orow.data());
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) {
          T* dst = out + ((i0 + i) * Hq + h * G + g) * D;
          const float* o = of.data() + (i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d]);
        }
    }
  });
}
#endif

bool supported() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

torch::Tensor prefill(torch::Tensor q, torch::Tensor pool, torch::Tensor page_table, int64_t first,
                      int64_t num_kv_heads, int64_t page_stride, int64_t head_stride, int64_t kv_stride,
                      int64_t token_stride, int64_t page_size, double scale) {
  TORCH_CHECK(supported(), "paged_prefill_attention needs AVX-512, which this build has not");
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "paged_prefill_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == pool.scalar_type(), "q must be [L, Hq, D] in the pool's dtype");
  TORCH_CHECK(page_table.scalar_type() == torch::kLong && page_table.dim() == 1, "page_table must be [M] int64");
  TORCH_CHECK(pool.is_contiguous(), "the pool must be contiguous");
  q = q.contiguous();
  page_table = page_table.contiguous();
  const int64_t L = q.size(0), Hq = q.size(1), D = q.size(2), M = page_table.size(0);
  TORCH_CHECK(L > 0 && first >= 0 && first + L <= M * page_size, "the chunk must fit its pages");
  TORCH_CHECK(num_kv_heads > 0 && Hq % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(D % 16 == 0 && D <= 256, "the head size must be a multiple of 16 up to 256");
  const int64_t* tab = page_table.data_ptr<int64_t>();
  const int64_t pages = (first + L + page_size - 1) / page_size, num_pages = pool.size(0);
  for (int64_t i = 0; i < pages; ++i) TORCH_CHECK(tab[i] >= 0 && tab[i] < num_pages, "page ", tab[i], " outside the pool");
  auto out = torch::empty_like(q);
#if defined(__AVX512F__)
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    prefill_kernel<float>(q.data_ptr<float>(), pool.data_ptr<float>(), tab, out.data_ptr<float>(), L, first, Hq,
                          num_kv_heads, D, page_size, page_stride, head_stride, kv_stride, token_stride, s);
  } else if (q.scalar_type() == torch::kBFloat16) {
    prefill_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), pool.data_ptr<at::BFloat16>(), tab,
                                 out.data_ptr<at::BFloat16>(), L, first, Hq, num_kv_heads, D, page_size, page_stride,
                                 head_stride, kv_stride, token_stride, s);
  } else {
    TORCH_CHECK(false, "paged_prefill_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
#endif
  return out;
}

}  // namespace

void register_prefill_attention(pybind11::module& m) {
  m.def("paged_prefill_attention", &prefill, "causal prefill attention over paged K / V (CPU, AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_attention_supported", &supported, "whether this build has paged_prefill_attention");
}
