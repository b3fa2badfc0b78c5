// The Python-facing side of prefill_attention.h: causal prefill attention over paged K / V (CPU, AVX-512 or
// AVX2 + FMA), a chunk of L query tokens at positions first .. first + L - 1 of one sequence.
//
//   q          [L, Hq, D]   fp32 or bf16, unscaled (the pool fp32 or bf16, either with either)
//   pool       one layer's pages (strides as paged_decode_attention takes them)
//   page_table [M] int64    the sequence's pages, in token order (M * page_size >= first + L)
//   returns    [L, Hq, D]   q's dtype
//
// D must be a multiple of 16 (<= 256); prefill_attention_supported() says whether this build has the kernel.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "pool_dtypes.h"
#include "prefill_attention.h"

namespace {

bool prefill_supported() { return disagg_prefill::SUPPORTED; }

torch::Tensor prefill(torch::Tensor q, torch::Tensor pool, torch::Tensor page_table, int64_t first,
                      int64_t num_kv_heads, int64_t page_stride, int64_t head_stride, int64_t kv_stride,
                      int64_t token_stride, int64_t page_size, double scale) {
  TORCH_CHECK(prefill_supported(), "paged_prefill_attention needs AVX-512 or AVX2 + FMA, which this build has not");
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "paged_prefill_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3, "q must be [L, Hq, D]");
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
#if defined(__AVX512F__) || defined(DISAGG_ATTN_AVX2)
  const float s = static_cast<float>(scale);
  const auto par = [](int64_t b, int64_t e, int64_t grain, const auto& fn) { at::parallel_for(b, e, grain, fn); };
  disagg_dtypes::with_dtypes(q, pool, "paged_prefill_attention", [&](auto qt, auto pt) {
    using QT = typename decltype(qt)::type;
    using PT = typename decltype(pt)::type;
    disagg_prefill::prefill_kernel<QT, PT>(q.data_ptr<QT>(), pool.data_ptr<PT>(), tab, out.data_ptr<QT>(), L, first, Hq,
                                           num_kv_heads, D, page_size, page_stride, head_stride, kv_stride,
                                           token_stride, s, par);
  });
#endif
  return out;
}

}  // namespace

void register_prefill_attention(pybind11::module& m) {
  m.def("paged_prefill_attention", &prefill, "causal prefill attention over paged K / V (CPU, AVX-512 or AVX2)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_attention_supported", &prefill_supported, "whether this build has paged_prefill_attention");
}
