// The eager model's row-wise pieces in one pass each (CPU; fp32 or bf16 tensors, fp32 math), where PyTorch's ops
// take several passes and a temporary each (SmolLM2, a 256-token prefill, one thread: SiLU and its product
// 10.7 ms, the rotary embedding and the KV write 10 ms, of ~290 ms):
//
//   silu_mul(x [T, 2I]) -> [T, I]        SiLU(x[:, :I]) * x[:, I:] (GatedMLP's gate_up output)
//   rope_write_kv(qkv [T, Hq + 2 Hkv, D], cos [T, D / 2], sin, pool, pages [T], offsets [T], hq, hkv, page_size,
//                 page_stride, head_stride, kv_stride, token_stride)
//                                         the Hq query and Hkv key heads rotated in place (HF's rotate_half),
//                                         each token's K and V heads written into its pool slot (the pool fp32
//                                         or bf16, either with qkv's; its strides as paged_decode_attention
//                                         takes them)
//   argmax_rows(x [R, V] fp32) -> [R] int64
//                                         torch.argmax(x, -1): the first index of each row's largest value, of
//                                         its first NaN if it has one (PyTorch's is a scalar pass, ~1 ns a value:
//                                         0.7-1.3 ms of a batch-16 step's greedy sampling over SmolLM2's 49,152)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "pool_dtypes.h"
#include "rows.h"

namespace {

template <typename T>
void load(const T* x, float* out, int64_t n) {
  if constexpr (std::is_same_v<T, float>)
    std::copy(x, x + n, out);
  else
    disagg_rows::to_float(x, out, n);
}

template <typename T>
void store(const float* x, T* out, int64_t n) {
  if constexpr (std::is_same_v<T, float>)
    std::copy(x, x + n, out);
  else
    disagg_rows::to_bf16(x, out, n);
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / I), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(3 * I);
    for (int64_t r = r0; r < r1; ++r) {
      load(x + r * 2 * I, buf.data(), 2 * I);
      disagg_rows::silu_mul(buf.data(), buf.data() + I, buf.data() + 2 * I, I);
      store(buf.data() + 2 * I, out + r * I, I);
    }
  });
}

torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul takes x [T, 2I] on the CPU");
  x = x.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({T, I}, x.options());
  if (x.scalar_type() == torch::kFloat)
    silu_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), T, I);
  else if (x.scalar_type() == torch::kBFloat16)
    silu_mul_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), T, I);
  else
    TORCH_CHECK(false, "silu_mul supports float32 and bfloat16, got ", x.scalar_type());
  return out;
}

template <typename T, typename PT>
void rope_kv_rows(T* qkv, const T* cos, const T* sin, PT* pool, const int64_t* pages, const int64_t* offsets,
                  int64_t tokens, int64_t hq, int64_t hkv, int64_t D, int64_t page_stride, int64_t head_stride,
                  int64_t kv_stride, int64_t token_stride) {
  const int64_t width = (hq + 2 * hkv) * D;
  at::parallel_for(0, tokens, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> head(D), cs(D);
    for (int64_t t = t0; t < t1; ++t) {
      load(cos + t * (D / 2), cs.data(), D / 2);
      load(sin + t * (D / 2), cs.data() + D / 2, D / 2);
      T* row = qkv + t * width;
      PT* slot = pool + pages[t] * page_stride + offsets[t] * token_stride;
      for (int64_t h = 0; h < hq + hkv; ++h) {
        load(row + h * D, head.data(), D);
        disagg_rows::rope(head.data(), cs.data(), cs.data() + D / 2, D);
        store(head.data(), row + h * D, D);
        if (h >= hq) {  // a key head: K and V into the slot
          PT* k = slot + (h - hq) * head_stride;
          std::copy(row + h * D, row + (h + 1) * D, k);
          std::copy(row + (h + hkv) * D, row + (h + hkv + 1) * D, k + kv_stride);
        }
      }
    }
  });
}

void rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor pool, torch::Tensor pages,
                   torch::Tensor offsets, int64_t hq, int64_t hkv, int64_t page_size, int64_t page_stride,
                   int64_t head_stride, int64_t kv_stride, int64_t token_stride) {
  TORCH_CHECK(qkv.device().is_cpu() && pool.device().is_cpu(), "rope_write_kv runs on the CPU");
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && hq > 0 && hkv > 0 && qkv.size(1) == hq + 2 * hkv,
              "qkv must be a contiguous [T, hq + 2 hkv, D]");
  const int64_t tokens = qkv.size(0), D = qkv.size(2);
  TORCH_CHECK(D % 2 == 0, "the rotary embedding needs an even head size");
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dt && sin.scalar_type() == dt, "qkv, cos and sin must share a dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "cos and sin must be [T, D / 2]");
  TORCH_CHECK(pool.is_contiguous(), "the pool must be contiguous");
  TORCH_CHECK(pages.scalar_type() == torch::kLong && offsets.scalar_type() == torch::kLong && pages.numel() == tokens &&
                  offsets.numel() == tokens,
              "pages and offsets: one int64 each a token");
  cos = cos.contiguous();
  sin = sin.contiguous();
  pages = pages.contiguous();
  offsets = offsets.contiguous();
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  const int64_t num_pages = pool.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pg[t] >= 0 && pg[t] < num_pages && of[t] >= 0 && of[t] < page_size,
                "slot (", pg[t], ", ", of[t], ") outside the pool (", num_pages, " pages of ", page_size, ")");
  disagg_dtypes::with_dtypes(qkv, pool, "rope_write_kv", [&](auto xt, auto pt) {
    using T = typename decltype(xt)::type;
    using PT = typename decltype(pt)::type;
    rope_kv_rows(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), pool.data_ptr<PT>(), pg, of, tokens, hq, hkv, D,
                 page_stride, head_stride, kv_stride, token_stride);
  });
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The index of x[0 .. n)'s first NaN (argmax_row's vector loops saw one).
int64_t first_nan(const float* x, int64_t n) {
  int64_t j = 0;
  while (j < n && !std::isnan(x[j])) ++j;
  return j;
}

// L lanes' largest values and their first indices -> the first largest of them (ties to the lower index; every
// lane -inf: index 0, the first value).
template <int L>
void first_largest(const float* mv, const int32_t* mi, float& top, int64_t& best) {
  top = mv[0];
  best = mi[0];
  for (int l = 1; l < L; ++l)
    if (mv[l] > top || (mv[l] == top && mi[l] < best)) top = mv[l], best = mi[l];
  if (top == -std::numeric_limits<float>::infinity()) best = 0;
}
#endif

// The first index of x[0 .. n)'s largest value (of its first NaN if any), as torch.argmax.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  if (n >= 16) {  // each lane keeps its first largest value and where (strictly greater replaces)
    __m512 vmax = _mm512_set1_ps(top);
    __m512i vidx = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, at);
      at = _mm512_add_epi32(at, step);
    }
    if (nan != 0) return first_nan(x, n);
    alignas(64) float mv[16];
    alignas(64) int32_t mi[16];
    _mm512_store_ps(mv, vmax);
    _mm512_store_si512(mi, vidx);
    first_largest<16>(mv, mi, top, best);
  }
#elif defined(__AVX2__)
  if (n >= 8) {  // as above in 8 lanes (a plain loop before session 44 on AVX2-only CPUs)
    __m256 vmax = _mm256_set1_ps(top), nan = _mm256_setzero_ps();
    __m256i vidx = _mm256_setzero_si256(), at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_blendv_epi8(vidx, at, _mm256_castps_si256(gt));
      at = _mm256_add_epi32(at, step);
    }
    if (_mm256_movemask_ps(nan) != 0) return first_nan(x, n);
    alignas(32) float mv[8];
    alignas(32) int32_t mi[8];
    _mm256_store_ps(mv, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(mi), vidx);
    first_largest<8>(mv, mi, top, best);
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], best = i;
  }
  return best;
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) > 0,
              "argmax_rows takes x [R, V] float32 on the CPU, V > 0");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: rows of at most 2^31 - 1 values");
  x = x.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

}  // namespace

void register_row_ops(pybind11::module& m) {
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of a float32 [R, V] in one vector pass (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "SiLU(x[:, :I]) * x[:, I:] in one pass (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv, "rotary embedding of q and k heads in place, K / V into their slots (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
