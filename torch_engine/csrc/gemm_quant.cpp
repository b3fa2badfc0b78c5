// Weight-only GEMM over GGUF-style block-quantized weights (torch_engine/quant.py): y[R, N] = x[R, K] @ W^T
// (+ bias), W kept packed (Q8_0, Q4_0, Q4_1; blocks of 32 along K), x in fp32 or bf16. The decode shape:
// a few rows, each weight read once per step at its packed size (Q4_1: 0.625 bytes a weight, 6.4x less
// than fp32).
//
// Per block of 32 weights and row r: t = sum(q_i * x_i) in fp32 (the quants are small integers, exact
// in fp32), then y += d * t, and for the offset formats + m * sum(x) (Q4_1) or - 8 * d * sum(x) (Q4_0),
// with sum(x) per block computed once per call. That is the dequantised GEMM's sum, rounded differently.
// With AVX2 + FMA (+ F16C for the fp16 scales) each block's quants become four 8-float vectors in
// registers, shared by the rows of x and by NR output rows at once (independent FMA chains); without
// AVX2 a scalar loop (the compiler's vectorisation). Output rows are split over threads.
//
//   gemm_q(x [R, K], kind, qs, d, m or empty, bias [N] or empty) -> [R, N] in x's dtype
//   dequant_q(kind, qs, d, m or empty) -> [N, K] fp32 (the prefill path: dense tiles for the BLAS)
//   gemm_q_path() -> "avx2" or "scalar"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DISAGG_Q_AVX2 1
#endif

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t PREFETCH = 512;  // bytes ahead in a weight row
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

inline float half_to_float(const at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

struct Weights {
  Kind kind;
  const uint8_t* qs;  // Q4: K / 2 bytes a row; Q8: K int8 a row
  const at::Half* d;
  const at::Half* m;  // Q4_1 only
  int64_t K;
  int64_t row_bytes() const { return kind == Q8_0 ? K : K / 2; }
};

#if defined(DISAGG_Q_AVX2)
// The 32 weights of one block as four vectors of 8 floats (integer quants, offset not applied).
template <Kind KD>
inline void load_block(const uint8_t* q, __m256 out[4]) {
  if constexpr (KD == Q8_0) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m128i a = _mm256_castsi256_si128(raw), b = _mm256_extracti128_si256(raw, 1);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  } else {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output rows [n0, n0 + NR) for input rows [r0, r0 + R); the format a template argument (a run-time
// one cost 1.7-4x here: the compiler no longer keeps the block's vectors in registers).
template <Kind KD, int R, int NR>
void tile(const Weights& w, const float* x, const float* xsum, float* y, int64_t N, int64_t n0, int64_t r0) {
  constexpr int64_t qb = KD == Q8_0 ? BLOCK : BLOCK / 2;
  const int64_t K = w.K, NB = K / BLOCK;
  const uint8_t* __restrict qs = w.qs;
  const at::Half* __restrict ds = w.d;
  const at::Half* __restrict ms = w.m;
  __m256 acc[NR][R];
  float off[NR][R];
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) {
      acc[j][r] = _mm256_setzero_ps();
      off[j][r] = 0.f;
    }
  for (int64_t b = 0; b < NB; ++b) {
    for (int j = 0; j < NR; ++j) {
      const int64_t n = n0 + j;
      _mm_prefetch(reinterpret_cast<const char*>(qs + n * (NB * qb) + b * qb + PREFETCH), _MM_HINT_T0);
      __m256 q[4];
      load_block<KD>(qs + n * (NB * qb) + b * qb, q);
      const float d = half_to_float(ds[n * NB + b]);
      const __m256 dv = _mm256_set1_ps(d);
      float o = 0.f;
      if constexpr (KD == Q4_1) o = half_to_float(ms[n * NB + b]);
      if constexpr (KD == Q4_0) o = -8.f * d;
      for (int r = 0; r < R; ++r) {
        const float* xb = x + (r0 + r) * K + b * BLOCK;
        const __m256 t0 = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xb), _mm256_mul_ps(q[1], _mm256_loadu_ps(xb + 8)));
        const __m256 t1 =
            _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), _mm256_mul_ps(q[3], _mm256_loadu_ps(xb + 24)));
        acc[j][r] = _mm256_fmadd_ps(dv, _mm256_add_ps(t0, t1), acc[j][r]);
        if constexpr (KD != Q8_0) off[j][r] += o * xsum[(r0 + r) * NB + b];
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < R; ++r) y[(r0 + r) * N + n0 + j] = hsum(acc[j][r]) + off[j][r];
}

template <Kind KD, int R>
void rows(const Weights& w, const float* x, const float* xsum, float* y, int64_t N, int64_t n0, int64_t n1,
          int64_t r0) {
  constexpr int NR = R == 1 ? 4 : (R == 2 ? 2 : 1);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<KD, R, NR>(w, x, xsum, y, N, n, r0);
  for (; n < n1; ++n) tile<KD, R, 1>(w, x, xsum, y, N, n, r0);
}

template <Kind KD>
void all_rows(const Weights& w, const float* x, const float* xsum, float* y, int64_t R, int64_t N, int64_t n0,
              int64_t n1) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) rows<KD, 4>(w, x, xsum, y, N, n0, n1, r);
  switch (R - r) {
    case 3: rows<KD, 3>(w, x, xsum, y, N, n0, n1, r); break;
    case 2: rows<KD, 2>(w, x, xsum, y, N, n0, n1, r); break;
    case 1: rows<KD, 1>(w, x, xsum, y, N, n0, n1, r); break;
    default: break;
  }
}
#endif

// The scalar path: element values as quant.py's dequantisation computes them.
void rows_scalar(const Weights& w, const float* x, float* y, int64_t R, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K = w.K, NB = K / BLOCK;
  std::vector<float> row(K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = w.qs + n * w.row_bytes();
    for (int64_t b = 0; b < NB; ++b) {
      const float d = half_to_float(w.d[n * NB + b]);
      const float m = w.kind == Q4_1 ? half_to_float(w.m[n * NB + b]) : 0.f;
      for (int64_t i = 0; i < BLOCK; ++i) {
        float v;
        if (w.kind == Q8_0) {
          v = d * static_cast<float>(static_cast<int8_t>(q[b * BLOCK + i]));
        } else {
          const uint8_t byte = q[b * BLOCK / 2 + (i % 16)];
          const int nib = i < 16 ? (byte & 0x0F) : (byte >> 4);
          v = w.kind == Q4_0 ? d * static_cast<float>(nib - 8) : d * static_cast<float>(nib) + m;
        }
        row[b * BLOCK + i] = v;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += row[k] * x[r * K + k];
      y[r * N + n] = s;
    }
  }
}

Weights weights_of(int64_t kind, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m) {
  TORCH_CHECK(kind == Q4_0 || kind == Q4_1 || kind == Q8_0, "unknown quant kind ", kind);
  TORCH_CHECK(d.scalar_type() == torch::kHalf && d.dim() == 2 && d.is_contiguous(), "d must be [N, K/32] fp16");
  const int64_t N = d.size(0), K = d.size(1) * BLOCK;
  const int64_t row_bytes = kind == Q8_0 ? K : K / 2;
  TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1 && qs.numel() == N * row_bytes, "qs does not fit d");
  const at::Half* mp = nullptr;
  if (kind == Q4_1) {
    TORCH_CHECK(m.defined() && m.scalar_type() == torch::kHalf && m.is_contiguous() && m.numel() == N * (K / BLOCK),
                "Q4_1 needs m [N, K/32] fp16");
    mp = m.data_ptr<at::Half>();
  }
  return Weights{static_cast<Kind>(kind), static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(), mp, K};
}

torch::Tensor gemm_q(torch::Tensor x, int64_t kind, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                     torch::Tensor bias) {
  const Weights w = weights_of(kind, qs, d, m);
  const int64_t N = d.size(0), K = w.K;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "gemm_q takes x [R, ", K, "]");
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == torch::kFloat || out_dtype == torch::kBFloat16, "gemm_q takes fp32 or bf16 x");
  const torch::Tensor xf = x.to(torch::kFloat).contiguous();
  const int64_t R = xf.size(0), NB = K / BLOCK;
  auto y = torch::empty({R, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(DISAGG_Q_AVX2)
  std::vector<float> xsum(R * NB, 0.f);
  if (w.kind != Q8_0)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < NB; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < BLOCK; ++i) s += xp[r * K + b * BLOCK + i];
        xsum[r * NB + b] = s;
      }
  const float* xs = xsum.data();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (w.kind) {
      case Q8_0: all_rows<Q8_0>(w, xp, xs, yp, R, N, n0, n1); break;
      case Q4_0: all_rows<Q4_0>(w, xp, xs, yp, R, N, n0, n1); break;
      case Q4_1: all_rows<Q4_1>(w, xp, xs, yp, R, N, n0, n1); break;
    }
  });
#else
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { rows_scalar(w, xp, yp, R, N, n0, n1); });
#endif
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == N, "bias must be [N]");
    y.add_(bias.to(torch::kFloat));
  }
  return out_dtype == torch::kFloat ? y : y.to(out_dtype);
}

torch::Tensor dequant_q(int64_t kind, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  const Weights w = weights_of(kind, qs, d, m);
  const int64_t N = d.size(0), K = w.K, NB = K / BLOCK;
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* q = w.qs + n * w.row_bytes();
      for (int64_t b = 0; b < NB; ++b) {
        const float dv = half_to_float(w.d[n * NB + b]);
        const float mv = w.kind == Q4_1 ? half_to_float(w.m[n * NB + b]) : 0.f;
        float* o = op + n * K + b * BLOCK;
        if (w.kind == Q8_0) {
          for (int64_t i = 0; i < BLOCK; ++i) o[i] = dv * static_cast<float>(static_cast<int8_t>(q[b * BLOCK + i]));
        } else {
          for (int64_t i = 0; i < BLOCK / 2; ++i) {
            const uint8_t byte = q[b * BLOCK / 2 + i];
            const float lo = static_cast<float>(byte & 0x0F), hi = static_cast<float>(byte >> 4);
            o[i] = w.kind == Q4_0 ? dv * (lo - 8.f) : dv * lo + mv;
            o[i + 16] = w.kind == Q4_0 ? dv * (hi - 8.f) : dv * hi + mv;
          }
        }
      }
    }
  });
  return out;
}

std::string path() {
#if defined(DISAGG_Q_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

void register_gemm_quant(pybind11::module& m) {
  m.def("gemm_q", &gemm_q, "weight-only GEMM over block-quantized weights (Q8_0 / Q4_0 / Q4_1)");
  m.def("dequant_q", &dequant_q, "block-quantized weight -> dense fp32");
  m.def("gemm_q_path", &path, "the instruction set gemm_q was built for");
}
