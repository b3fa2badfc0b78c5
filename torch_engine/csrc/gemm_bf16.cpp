// Small-batch bf16 GEMM for CPUs with AVX-512 BF16: y[R, N] = x[R, K] @ W^T (+ bias), the decode shape
// (R = a few rows, W a whole weight matrix read once per step).
//
// The weight is packed once (``pack_bf16``, Python side) as [N / 16, K / 2, 16, 2]: for each block of
// 16 outputs, each pair of k values of all 16 outputs is one 64-byte line. One vdpbf16ps multiplies
// that line by a broadcast pair of an input row and accumulates 16 outputs at once, so there are no
// horizontal sums, and each block's weights are one sequential stream. With SmolLM2's 121 GEMMs of
// a step (one thread): 10.0 / 10.0 / 11.3 / 21.6 ms at 1 / 2 / 4 / 8 rows, against oneDNN's packed
// GEMM at 18.3 / 18.5 / 19.1 / 24.3 ms; at 16 rows the dot products bind and oneDNN wins (35 vs 43),
// so the engine sends more than 8 rows there. Up to 4 accumulators per row hide vdpbf16ps's latency
// at 1-2 rows. Output blocks are split over threads.
//
//   gemm_bf16(x [R, K] bf16, packed [N/16, K/2, 16, 2] bf16, bias [N] bf16 or empty, N) -> [R, N] bf16
//   requires N % 16 == 0, K % 2 == 0, 1 <= R <= 16; gemm_bf16_supported() says whether this build has it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bf16gemm.h"

namespace {

#if defined(DISAGG_HAS_BF16_GEMM)
template <int R, int U>
void tile(const at::BFloat16* x, int64_t K, const at::BFloat16* wb, const at::BFloat16* bias, at::BFloat16* out,
          int64_t N, int64_t n0) {
  __m512 s[R];
  disagg_bf16::dot16<R, U>(x, K, wb, s);
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n0));
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + n0), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(s[r], b)));
}

template <int R>
void run(const at::BFloat16* x, int64_t K, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* out,
         int64_t N) {
  constexpr int U = R == 1 ? 4 : (R == 2 ? 2 : 1);
  at::parallel_for(0, N / 16, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) tile<R, U>(x, K, w + nb * K * 16, bias, out, N, nb * 16);
  });
}

using RunFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, const at::BFloat16*, at::BFloat16*, int64_t);
constexpr RunFn RUNS[] = {run<1>, run<2>,  run<3>,  run<4>,  run<5>,  run<6>,  run<7>,  run<8>,
                          run<9>, run<10>, run<11>, run<12>, run<13>, run<14>, run<15>, run<16>};
#endif

bool supported() {
#if defined(DISAGG_HAS_BF16_GEMM)
  return true;
#else
  return false;
#endif
}

torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(supported(), "gemm_bf16 needs AVX-512 BF16, which this build has not");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16, "gemm_bf16 takes bf16");
  TORCH_CHECK(x.dim() == 2, "gemm_bf16 takes x [R, K]");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(R >= 1 && R <= 16, "gemm_bf16 takes 1 to 16 rows, got ", R);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "gemm_bf16 needs N % 16 == 0 and K % 2 == 0, got N ", N, ", K ", K);
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == N * K, "packed must be [N/16, K/2, 16, 2] for this x");
  x = x.contiguous();
  const at::BFloat16* bp = nullptr;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == torch::kBFloat16 && bias.numel() == N, "bias must be bf16 [N]");
    bias = bias.contiguous();
    bp = bias.data_ptr<at::BFloat16>();
  }
  auto out = torch::empty({R, N}, x.options());
#if defined(DISAGG_HAS_BF16_GEMM)
  RUNS[R - 1](x.data_ptr<at::BFloat16>(), K, packed.data_ptr<at::BFloat16>(), bp, out.data_ptr<at::BFloat16>(), N);
#endif
  return out;
}

}  // namespace

void register_gemm(pybind11::module& m) {
  m.def("gemm_bf16", &gemm_bf16, "small-batch bf16 GEMM over a VNNI-packed weight (AVX-512 BF16)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gemm_bf16_supported", &supported, "whether this build has the AVX-512 BF16 GEMM");
}
