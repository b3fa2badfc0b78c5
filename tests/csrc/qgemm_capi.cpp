// A C entry point over torch_engine/csrc/qgemm.h for tests/test_int8_kernels.py, which compiles this file
// once per instruction-set level (-march=x86-64, x86-64-v3, native) and checks that every path the engine
// may pick on some CPU computes the same GEMM. No torch: plain arrays.
#include <type_traits>
#include <vector>

#include "../../torch_engine/csrc/qgemm.h"

namespace {

// The activations' per-block sums the kernels take beside q / dx / s (quantize_rows makes them too)
struct Sums {
  std::vector<float> dxs, dxlo;
  std::vector<int32_t> slo;
  disagg_q::ActQ8 act(const int8_t* q, const float* dx, const int32_t* s, int64_t R, int64_t K) {
    const size_t n = static_cast<size_t>(R * (K / 32));
    dxs.assign(n, 0.0f);
    dxlo.assign(n, 0.0f);
    slo.assign(n, 0);  // the sum of each block's first 16 quants
    for (size_t i = 0; i < n; ++i) {
      dxs[i] = dx[i] * static_cast<float>(s[i]);
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
    return a;
  }
};

disagg_q::Q16 weight(int64_t kind, int64_t N, int64_t K, const uint8_t* qs, const uint16_t* d, const uint16_t* m) {
  disagg_q::Q16 w;
  w.kind = static_cast<disagg_q::Kind>(kind);
  w.N = N;
  w.K = K;
  w.qs = qs;
  w.d = d;
  w.m = m;
  return w;
}

}  // namespace

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
  const disagg_q::Q16 w = weight(kind, N, K, qs, d, m);
  Sums sums;
  disagg_q::gemm_groups(w, sums.act(q, dx, s, R, K), R, 0, w.groups(), y, N, bias, accumulate != 0);
}

// AVX-512 VNNI only (else returns 0): y [R, N] = the same product by tiles of R = 8 or 16 rows of the kinds with a
// minimum, their rows' chains issued side by side (group_tile's SBS, which rows_side_by_side() picks on Intel's
// cores only) or as two chains a row — whichever this CPU's gemm_groups does not take, so that both are tested.
int qgemm_gemm_other_tiles(int64_t kind, int64_t N, int64_t K, const uint8_t* qs, const uint16_t* d,
                           const uint16_t* m, const int8_t* q, const float* dx, const int32_t* s, int64_t R,
                           float* y) {
#if defined(DISAGG_I8_AVX512)
  using namespace disagg_q;
  const Q16 w = weight(kind, N, K, qs, d, m);
  Sums sums;
  const ActQ8 a = sums.act(q, dx, s, R, K);
  const bool sbs = !rows_side_by_side();
  auto run = [&](auto kd) {
    constexpr Kind KD = decltype(kd)::value;
    for (int64_t g = 0; g < w.groups(); ++g) {
      if (R == 8 && sbs) group_tile<KD, 8, true>(w, a, 0, g, y, N, nullptr, false);
      if (R == 8 && !sbs) group_tile<KD, 8, false>(w, a, 0, g, y, N, nullptr, false);
      if (R == 16 && sbs) group_tile<KD, 16, true>(w, a, 0, g, y, N, nullptr, false);
      if (R == 16 && !sbs) group_tile<KD, 16, false>(w, a, 0, g, y, N, nullptr, false);
    }
  };
  if (R != 8 && R != 16) return 0;
  switch (w.kind) {
    case Q4_1: run(std::integral_constant<Kind, Q4_1>{}); return 1;
    case Q5_1: run(std::integral_constant<Kind, Q5_1>{}); return 1;
    case Q4_K: run(std::integral_constant<Kind, Q4_K>{}); return 1;
    case Q5_K: run(std::integral_constant<Kind, Q5_K>{}); return 1;
    default: return 0;
  }
#else
  static_cast<void>(kind), static_cast<void>(N), static_cast<void>(K), static_cast<void>(qs), static_cast<void>(d);
  static_cast<void>(m), static_cast<void>(q), static_cast<void>(dx), static_cast<void>(s), static_cast<void>(R);
  static_cast<void>(y);
  return 0;
#endif
}
}
