// The engine's CPU kernels (loaded by torch_engine/kernels.py).
//
// Fused paged decode attention for CPUs: one query token per sequence, K/V read straight from the
// pages (no gather into a new tensor), online softmax in fp32, any page layout (strides given).
//
//   q          [B, Hq, D]            fp32 or bf16 (the pool's dtype)
//   pool       [N, ...]              one layer's pages; K of (page, head, token) at
//                                    page * page_stride + head * head_stride + token * token_stride,
//                                    V at the same place + kv_stride
//   page_table [B, M] int64          pages of each sequence, in token order
//   kv_lens    [B] int64             tokens of KV per sequence (the query's own token included)
//   returns    [B, Hq, D]            q's dtype
//
// Grouped-query attention: the G = Hq / Hkv query heads of a KV head share each K and V load.
// Work is split over (sequence, KV head) pairs with at::parallel_for.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX512F__)
// 16 elements -> 16 floats (bf16: the 16 bits become the high half of an fp32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// dot(qg, row) for D a multiple of 16
template <typename T>
inline float dot16(const float* qg, const T* row, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), load16(row + d), acc);
  return _mm512_reduce_add_ps(acc);
}

// ag += p * row for D a multiple of 16
template <typename T>
inline void axpy16(float* ag, float p, const T* row, int64_t D) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t d = 0; d < D; d += 16)
    _mm512_storeu_ps(ag + d, _mm512_fmadd_ps(pv, load16(row + d), _mm512_loadu_ps(ag + d)));
}
#endif

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

// One (sequence, KV head) job, a page of tokens at a time: the G query heads' scores for the page,
// one rescale of the running sums per page (not per token), the exponentials of the whole page in
// one vectorisable loop, then the page's values accumulated; K and V rows are converted once each.
template <typename T, int64_t KD>
void decode_job(const T* q, const T* pool, const int64_t* row, int64_t n, T* out, int64_t G, int64_t dyn_d, int64_t P,
                int64_t page_stride, int64_t kv_stride, int64_t token_stride, float scale, float* qf, float* acc,
                float* kv, float* sc, float* m, float* l) {
  const int64_t D = KD > 0 ? KD : dyn_d;  // head sizes of real models are compile-time constants: unrolled
  for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + G, 0.0f);
  for (int64_t start = 0; start < n; start += P) {
    const int64_t len = std::min(P, n - start);
    const T* base = pool + row[start / P] * page_stride;
    for (int64_t t = 0; t < len; ++t) {  // scores of the page: sc[g * P + t]
      const T* kp = base + t * token_stride;
#if defined(__AVX512F__)
      if (D % 16 == 0) {
        for (int64_t g = 0; g < G; ++g) sc[g * P + t] = dot16(qf + g * D, kp, D);
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) kv[d] = static_cast<float>(kp[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kv[d];
        sc[g * P + t] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {  // one rescale per page, exponentials of the whole page
      float* sg = sc + g * P;
      float mp = m[g];
      for (int64_t t = 0; t < len; ++t) mp = std::max(mp, sg[t]);
      const float c = std::exp(m[g] - mp);
      m[g] = mp;
      float sum = 0.0f;
      for (int64_t t = 0; t < len; ++t) {
        sg[t] = std::exp(sg[t] - mp);
        sum += sg[t];
      }
      l[g] = l[g] * c + sum;
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] *= c;
    }
    for (int64_t t = 0; t < len; ++t) {  // the page's values
      const T* vp = base + t * token_stride + kv_stride;
#if defined(__AVX512F__)
      if (D % 16 == 0) {
        for (int64_t g = 0; g < G; ++g) axpy16(acc + g * D, sc[g * P + t], vp, D);
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) kv[d] = static_cast<float>(vp[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = sc[g * P + t];
        float* ag = acc + g * D;
        for (int64_t d = 0; d < D; ++d) ag[d] += p * kv[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

template <typename T>
void decode_kernel(const T* q, const T* pool, const int64_t* table, const int64_t* lens, T* out, int64_t B,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t M, int64_t P, int64_t page_stride,
                   int64_t head_stride, int64_t kv_stride, int64_t token_stride, float scale) {
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), kv(D), sc(G * P), m(G), l(G);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / Hkv, h = job % Hkv;
      const int64_t offset = (b * Hq + h * G) * D;
      auto job_fn = D == 64 ? decode_job<T, 64> : D == 128 ? decode_job<T, 128> : decode_job<T, 0>;
      job_fn(q + offset, pool + h * head_stride, table + b * M, std::min(lens[b], M * P), out + offset, G, D, P,
             page_stride, kv_stride, token_stride, scale, qf.data(), acc.data(), kv.data(), sc.data(), m.data(),
             l.data());
    }
  });
}

torch::Tensor decode(torch::Tensor q, torch::Tensor pool, torch::Tensor page_table, torch::Tensor kv_lens,
                     int64_t num_kv_heads, int64_t page_stride, int64_t head_stride, int64_t kv_stride,
                     int64_t token_stride, int64_t page_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D]");
  TORCH_CHECK(q.scalar_type() == pool.scalar_type(), "q and the pool must share a dtype");
  TORCH_CHECK(page_table.scalar_type() == torch::kLong && kv_lens.scalar_type() == torch::kLong,
              "page_table and kv_lens must be int64");
  TORCH_CHECK(pool.is_contiguous(), "the pool must be contiguous");
  q = q.contiguous();
  page_table = page_table.contiguous();
  kv_lens = kv_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), M = page_table.size(1);
  TORCH_CHECK(page_table.size(0) == B && kv_lens.size(0) == B, "one page-table row and length per sequence");
  TORCH_CHECK(num_kv_heads > 0 && Hq % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), pool.data_ptr<float>(), page_table.data_ptr<int64_t>(),
                         kv_lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, Hq, num_kv_heads, D, M, page_size,
                         page_stride, head_stride, kv_stride, token_stride, s);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), pool.data_ptr<at::BFloat16>(),
                                page_table.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
                                out.data_ptr<at::BFloat16>(), B, Hq, num_kv_heads, D, M, page_size, page_stride,
                                head_stride, kv_stride, token_stride, s);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
  return out;
}

// RMSNorm of each row of x [T, H] with weight [H], fp32 accumulation; one pass per row, no temporaries.
template <typename T, typename W>
void rms_norm_kernel(const T* x, const W* w, T* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      float ss = 0.0f;
      for (int64_t i = 0; i < H; ++i) {
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      for (int64_t i = 0; i < H; ++i) o[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on the CPU");
  TORCH_CHECK(x.size(-1) == weight.numel(), "weight must match the last dimension");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t H = x.size(-1), rows = x.numel() / H;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat) {
    rms_norm_kernel<float, float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, H, e);
  } else if (x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kBFloat16) {
    rms_norm_kernel<at::BFloat16, at::BFloat16>(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                                                out.data_ptr<at::BFloat16>(), rows, H, e);
  } else if (x.scalar_type() == torch::kBFloat16 && weight.scalar_type() == torch::kFloat) {
    rms_norm_kernel<at::BFloat16, float>(x.data_ptr<at::BFloat16>(), weight.data_ptr<float>(),
                                         out.data_ptr<at::BFloat16>(), rows, H, e);
  } else {
    TORCH_CHECK(false, "rms_norm supports float32 and bfloat16 inputs");
  }
  return out;
}

}  // namespace

void register_gemm(pybind11::module& m);        // gemm_bf16.cpp
void register_gemm_quant(pybind11::module& m);  // gemm_quant.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_gemm(m);
  register_gemm_quant(m);
  m.def("paged_decode_attention", &decode, "fused paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, fp32 accumulation (CPU)");
}
