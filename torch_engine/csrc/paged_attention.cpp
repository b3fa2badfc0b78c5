// The engine's CPU kernels (loaded by torch_engine/kernels.py).
//
// Fused paged decode attention for CPUs: one query token per sequence, K/V read straight from the
// pages (no gather into a new tensor), online softmax in fp32, any page layout (strides given).
//
//   q          [B, Hq, D]            fp32 or bf16 (the pool: fp32 or bf16, either with either)
//   pool       [N, ...]              one layer's pages; K of (page, head, token) at
//                                    page * page_stride + head * head_stride + token * token_stride,
//                                    V at the same place + kv_stride
//   page_table [B, M] int64          pages of each sequence, in token order
//   kv_lens    [B] int64             tokens of KV per sequence (the query's own token included)
//   returns    [B, Hq, D]            q's dtype
//
// Grouped-query attention: the G = Hq / Hkv query heads of a KV head share each K and V load.
// Work is split over sequences with at::parallel_for (each reads its pages in address order).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention.h"
#include "pool_dtypes.h"

namespace {

using disagg_attn::decode_job;

template <typename QT, typename PT>
void decode_kernel(const QT* q, const PT* pool, const int64_t* table, const int64_t* lens, QT* out, int64_t B,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t M, int64_t P, int64_t page_stride,
                   int64_t head_stride, int64_t kv_stride, int64_t token_stride, float scale) {
  const int64_t G = Hq / Hkv;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(Hq * D), m(Hq), l(Hq), scratch(disagg_attn::scratch_floats(D, Hq));
    for (int64_t b = begin; b < end; ++b) {
      auto job_fn = D == 64    ? decode_job<QT, PT, QT, 64>
                    : D == 128 ? decode_job<QT, PT, QT, 128>
                               : decode_job<QT, PT, QT, 0>;
      job_fn(q + b * Hq * D, pool, Hkv, head_stride, table + b * M, std::min(lens[b], M * P), out + b * Hq * D, G, D,
             P, page_stride, kv_stride, token_stride, scale, qf.data(), acc.data(), m.data(), l.data(),
             scratch.data());
    }
  });
}

torch::Tensor decode(torch::Tensor q, torch::Tensor pool, torch::Tensor page_table, torch::Tensor kv_lens,
                     int64_t num_kv_heads, int64_t page_stride, int64_t head_stride, int64_t kv_stride,
                     int64_t token_stride, int64_t page_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3, "q must be [B, Hq, D]");
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
  disagg_dtypes::with_dtypes(q, pool, "paged_decode_attention", [&](auto qt, auto pt) {
    using QT = typename decltype(qt)::type;
    using PT = typename decltype(pt)::type;
    decode_kernel<QT, PT>(q.data_ptr<QT>(), pool.data_ptr<PT>(), page_table.data_ptr<int64_t>(),
                          kv_lens.data_ptr<int64_t>(), out.data_ptr<QT>(), B, Hq, num_kv_heads, D, M, page_size,
                          page_stride, head_stride, kv_stride, token_stride, s);
  });
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

// Grammar masks: logits[rows[i], t] = -inf for every token t whose bit in masks[i] (int32 words, bit t % 32
// of word t / 32) is clear; tokens past the mask's words are disallowed. In place; fp32 logits, rows unit-stride.
void mask_logits(torch::Tensor logits, std::vector<int64_t> rows, torch::Tensor masks) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "mask_logits: fp32 CPU logits [S, V] with unit-stride rows");
  TORCH_CHECK(masks.scalar_type() == torch::kInt && masks.dim() == 2 && masks.is_contiguous() &&
                  masks.size(0) == static_cast<int64_t>(rows.size()),
              "mask_logits: one contiguous int32 mask row per logits row");
  const int64_t V = logits.size(1), W = masks.size(1), ld = logits.stride(0), S = logits.size(0);
  float* L = logits.data_ptr<float>();
  const uint32_t* M = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < S, "mask_logits: row ", rows[i], " out of range");
    float* row = L + rows[i] * ld;
    const uint32_t* m = M + static_cast<int64_t>(i) * W;
    for (int64_t w = 0; w * 32 < V; ++w) {
      const uint32_t bits = w < W ? m[w] : 0u;
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t t0 = w * 32, n = std::min<int64_t>(32, V - t0);
      for (int64_t j = 0; j < n; ++j)
        if (((bits >> j) & 1u) == 0u) row[t0 + j] = -std::numeric_limits<float>::infinity();
    }
  }
}

}  // namespace

void register_gemm(pybind11::module& m);        // gemm_bf16.cpp
void register_gemm_quant(pybind11::module& m);  // gemm_quant.cpp
void register_decode_step(pybind11::module& m);  // decode_step.cpp
void register_prefill_attention(pybind11::module& m);  // prefill_attention.cpp
void register_row_ops(pybind11::module& m);  // row_ops.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_gemm(m);
  register_gemm_quant(m);
  register_decode_step(m);
  register_prefill_attention(m);
  register_row_ops(m);
  // the compute calls release the GIL: other Python threads (the grammar masks' worker, the messenger)
  // run beside them
  m.def("paged_decode_attention", &decode, "fused paged decode attention (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, fp32 accumulation (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("mask_logits", &mask_logits, "grammar masks applied to fp32 logits in place (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
