// Small-batch bf16 GEMM for CPUs with AVX-512 BF16: y[R, N] = x[R, K] @ W[N, K]^T (+ bias), the decode
// shape (R = a few rows, W = a whole weight matrix read once per step). Decode is bound by reading W;
// oneDNN's kernels for 1-16 rows read it at 14-17 GB/s here (SmolLM2's lm_head: 3.3 ms) while one
// core streams ~24 GB/s. One weight row at a time (one sequential stream: 24.8 GB/s, 2.3 ms for the
// lm_head), each row feeding every input row while it sits in L1, two accumulators per input row
// over K (vdpbf16ps), up to 8 input rows per pass. Output rows are split over threads.
//
//   gemm_bf16(x [R, K] bf16, w [N, K] bf16 contiguous, bias [N] bf16 or empty) -> [R, N] bf16
//   requires K % 32 == 0; gemm_bf16_supported() says whether this build has the instructions.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define DISAGG_HAS_BF16_DOT 1
#endif

namespace {

#if defined(DISAGG_HAS_BF16_DOT)
inline __m512bh load_bh(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p)); }

// R input rows (R <= 8) against weight rows [n0, n1): out[r * ldo + n] = x[r] . w[n] + bias[n]
template <int R>
void rows(const at::BFloat16* x, int64_t K, const at::BFloat16* w, const at::BFloat16* bias, int64_t n0,
          int64_t n1, at::BFloat16* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* wr = w + n * K;
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const __m512bh w0 = load_bh(wr + k), w1 = load_bh(wr + k + 32);
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm512_dpbf16_ps(a0[r], load_bh(x + r * K + k), w0);
        a1[r] = _mm512_dpbf16_ps(a1[r], load_bh(x + r * K + k + 32), w1);
      }
    }
    if (k < K) {  // K % 64 == 32
      const __m512bh w0 = load_bh(wr + k);
      for (int r = 0; r < R; ++r) a0[r] = _mm512_dpbf16_ps(a0[r], load_bh(x + r * K + k), w0);
    }
    const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.0f;
    for (int r = 0; r < R; ++r) out[r * ldo + n] = at::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])) + b);
  }
}

using RowsFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, const at::BFloat16*, int64_t, int64_t,
                        at::BFloat16*, int64_t);
constexpr RowsFn ROWS[] = {rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};
#endif

bool supported() {
#if defined(DISAGG_HAS_BF16_DOT)
  return true;
#else
  return false;
#endif
}

torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(supported(), "gemm_bf16 needs AVX-512 BF16, which this build has not");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "gemm_bf16 takes bf16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemm_bf16 takes x [R, K] and w [N, K]");
  const int64_t R = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "gemm_bf16 needs K % 32 == 0, got ", K);
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "the weight must be contiguous");
  const at::BFloat16* bp = nullptr;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == torch::kBFloat16 && bias.numel() == N, "bias must be bf16 [N]");
    bias = bias.contiguous();
    bp = bias.data_ptr<at::BFloat16>();
  }
  auto out = torch::empty({R, N}, x.options());
#if defined(DISAGG_HAS_BF16_DOT)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
      const int64_t rn = std::min<int64_t>(8, R - r0);
      ROWS[rn - 1](xp + r0 * K, K, wp, bp, n0, n1, op + r0 * N, N);
    }
  });
#endif
  return out;
}

}  // namespace

void register_gemm(pybind11::module& m) {
  m.def("gemm_bf16", &gemm_bf16, "small-batch bf16 GEMM streaming the weight once (AVX-512 BF16)");
  m.def("gemm_bf16_supported", &supported, "whether this build has the AVX-512 BF16 GEMM");
}
