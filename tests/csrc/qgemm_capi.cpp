// A C entry point over torch_engine/csrc/qgemm.h for tests/test_int8_kernels.py, which compiles this file
// once per instruction-set level (-march=x86-64, x86-64-v3, native) and checks that every path the engine
// may pick on some CPU computes the same GEMM. No torch: plain arrays.
#include <vector>

#include "../../torch_engine/csrc/qgemm.h"

extern "C" {

const char* qgemm_path() { return disagg_q::i8_path(); }

// x [R, K] fp32 -> q [R, K] int8, dx / s [R, K / 32]
void qgemm_quantize(const float* x, int64_t R, int64_t K, int8_t* q, float* dx, int32_t* s) {
  std::vector<float> dxs(R * (K / 32));
  std::vector<int32_t> slo(R * (K / 32));
  std::vector<float> dxlo(R * (K / 32));
  disagg_q::quantize_rows(x, 0, R, K, q, dx, s, dxs.data(), slo.data(), dxlo.data());
}

// y [R, N] (+)= grouped weight (qs16 / d16 / m16, repacked as repack_q16 writes them) x quantized x
void qgemm_gemm(int64_t kind, int64_t N, int64_t K, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                const int8_t* q, const float* dx, const int32_t* s, int64_t R, float* y, const float* bias,
                int accumulate) {
  disagg_q::Q16 w;
  w.kind = static_cast<disagg_q::Kind>(kind);
  w.N = N;
  w.K = K;
  w.qs = qs;
  w.d = d;
  w.m = m;
  std::vector<float> dxs(R * (K / 32));
  std::vector<int32_t> slo(R * (K / 32));  // the sum of each block's first 16 quants
  std::vector<float> dxlo(R * (K / 32));
  for (size_t i = 0; i < dxs.size(); ++i) {
    dxs[i] = dx[i] * static_cast<float>(s[i]);
    slo[i] = 0;
    for (int64_t e = 0; e < 16; ++e) slo[i] += q[static_cast<int64_t>(i) * 32 + e];
    dxlo[i] = dx[i] * static_cast<float>(slo[i]);
  }
  disagg_q::ActQ8 a;
  a.q = q;
  a.dx = dx;
  a.s = s;
  a.dxs = dxs.data();
  a.slo = slo.data();
  a.dxlo = dxlo.data();
  a.K = K;
  disagg_q::gemm_groups(w, a, R, 0, w.groups(), y, N, bias, accumulate != 0);
}
}
