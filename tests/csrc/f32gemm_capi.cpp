// A C entry point over torch_engine/csrc/f32gemm.h for tests/test_f32_kernels.py, which compiles this file
// once per instruction-set level (-march=x86-64, x86-64-v3, native) and checks that every path the engine
// may pick on some CPU computes the same GEMM. No torch: plain arrays.
#include "../../torch_engine/csrc/f32gemm.h"

extern "C" {

const char* f32gemm_path() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

// y [R, ldy] (+)= x [R, K] @ W [N, K]^T (+ bias), groups [g0, g1) of 16 outputs
void f32gemm_gemm(const float* w, int64_t K, const float* x, int64_t R, int64_t g0, int64_t g1, float* y, int64_t ldy,
                  const float* bias, int accumulate) {
  disagg_f32::gemm_groups(w, K, x, R, g0, g1, y, ldy, bias, accumulate != 0);
}
}
