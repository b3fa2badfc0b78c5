// Integer GEMM over block-quantized weights kept as the GGUF stored them (torch_engine/quant.py), the
// Python-facing side of qgemm.h: repacking a weight into groups of 16 interleaved outputs, quantizing
// activations per 32-block, the GEMM, and dequantised rows (the embedding lookup, the prefill path's dense
// tiles). The decode shape: a few rows, each weight read once per step at its packed size (Q4_1: 0.625
// bytes a weight, 6.4x less than fp32).
//
//   repack_q16(kind, qs, d, m or empty, h or empty) -> [qs16, d16, m16 or empty]
//                   (m: Q4_1 / Q5_1's minimums, Q6_K / Q3_K's sub-block scales; h: Q5's / Q6_K's / Q3_K's high bits)
//   quantize_act(x [R, K]) -> [q int8 [R, K], dx fp32 [R, K/32], s int32 [R, K/32]]
//   gemm_q8(x [R, K], kind, qs16, d16, m16, N, bias [N] or empty, precise) -> [R, N] in x's dtype (fp32 or bf16)
//   rows_q16(kind, qs16, d16, m16, N, ids or empty) -> [len(ids) or N, K] fp32
//   i8_path() -> "avx512-vnni", "avx2" or "scalar"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "qgemm.h"

namespace {

using disagg_q::BLOCK;
using disagg_q::Q2_K;
using disagg_q::Q3_K;
using disagg_q::Q4_0;
using disagg_q::Q5_0;
using disagg_q::Q6_K;
using disagg_q::Q8_0;

// ---- the integer path (qgemm.h): weights repacked in groups of 16 outputs, activations quantized ----------

disagg_q::Q16 q16_of(int64_t kind, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m, int64_t N) {
  TORCH_CHECK(disagg_q::known_kind(kind), "unknown quant kind ", kind);
  TORCH_CHECK(d.dim() == 3 && d.size(2) == disagg_q::GROUP && d.element_size() == 2 && d.is_contiguous(),
              "d16 must be [groups, K/32 (Q6_K / Q3_K: K/256), 16] fp16");
  const auto k = static_cast<disagg_q::Kind>(kind);
  const int64_t G = d.size(0), NB = d.size(1) * disagg_q::scale_span(k) / BLOCK;
  TORCH_CHECK(N > 0 && (N + disagg_q::GROUP - 1) / disagg_q::GROUP == G, "N ", N, " does not fit ", G, " groups");
  TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1 && qs.numel() == G * NB * disagg_q::Q16::block_bytes(k),
              "qs16 does not fit d16");
  disagg_q::Q16 w;
  w.kind = k;
  w.N = N;
  w.K = NB * disagg_q::BLOCK;
  w.qs = static_cast<const uint8_t*>(qs.data_ptr());
  w.d = static_cast<const uint16_t*>(d.data_ptr());
  if (disagg_q::has_min(k) || disagg_q::sub_scales(k)) {  // 32 bytes a group and block: 16 fp16 minimums, or
                                                            // 2 x 16 bytes of scales (and Q2_K's minimums)
    TORCH_CHECK(m.defined() && m.is_contiguous() && m.numel() * m.element_size() == G * NB * 32,
                "Q4_1 / Q5_1 need m16 [groups, K/32, 16] fp16, Q6_K / Q3_K / Q2_K [groups, K/32, 32] bytes");
    w.m = static_cast<const uint16_t*>(m.data_ptr());
  }
  return w;
}

// The packed form (quant.py: qs [N, K or K/2] (Q3_K / Q2_K: K/4), d / m [N, K/32] (Q6_K / Q3_K: d [N, K/256], m
// [N, K/16] int8; Q4_K / Q5_K / Q2_K: d [N, K/128] (d, dmin), m [N, K/16] uint8 (sc, mn)), h [N, K/8] (Q6_K: [N, K/4]))
// -> [qs16, d16, m16 or empty] (qgemm.h; the bits above the nibbles go into qs16).
std::vector<torch::Tensor> repack_q16(int64_t kind, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                                      torch::Tensor h) {
  TORCH_CHECK(disagg_q::known_kind(kind), "unknown quant kind ", kind);
  const auto k = static_cast<disagg_q::Kind>(kind);
  const int64_t span = disagg_q::scale_span(k);
  TORCH_CHECK(d.scalar_type() == torch::kHalf && d.dim() == 2 && d.is_contiguous(),
              "d must be [N, K/32] (Q6_K / Q3_K: [N, K/256]; Q4_K / Q5_K: [N, K/128]) fp16");
  const int64_t N = d.size(0), K = d.size(1) * span, NB = K / BLOCK, ND = d.size(1), G = (N + 15) / 16;
  const bool six = k == Q6_K, three = k == Q3_K, crumbs = three || k == Q2_K;
  const bool paired = disagg_q::sub_scales(k) || disagg_q::two_level(k);  // m: two bytes a block
  const bool with_min = disagg_q::has_min(k) && !paired;
  const int planes = three ? 1 : disagg_q::high_planes(k);
  const int64_t row_bytes = kind == Q8_0 ? K : (crumbs ? K / 4 : K / 2);
  TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1 && qs.numel() == N * row_bytes, "qs does not fit d");
  if (with_min)
    TORCH_CHECK(m.defined() && m.scalar_type() == torch::kHalf && m.is_contiguous() && m.numel() == N * NB,
                "Q4_1 / Q5_1 need m [N, K/32] fp16");
  if (paired)
    TORCH_CHECK(m.defined() && m.element_size() == 1 && m.is_contiguous() && m.numel() == N * K / 16,
                "Q6_K / Q3_K need their sub-block scales m [N, K/16] int8, Q4_K / Q5_K / Q2_K their scales and "
                "minimums (uint8)");
  if (planes > 0)
    TORCH_CHECK(h.defined() && h.element_size() == 1 && h.is_contiguous() && h.numel() == N * K / 8 * planes,
                "Q5_0 / Q5_1 / Q3_K need h [N, K/8], Q6_K h [N, K/4] (uint8)");
  const uint8_t* hsrc = planes > 0 ? static_cast<const uint8_t*>(h.data_ptr()) : nullptr;
  const uint8_t* qsrc = static_cast<const uint8_t*>(qs.data_ptr());
  const at::Half* dsrc = d.data_ptr<at::Half>();
  const at::Half* msrc = with_min ? m.data_ptr<at::Half>() : nullptr;
  const uint8_t* scsrc = paired ? static_cast<const uint8_t*>(m.data_ptr()) : nullptr;
  const int64_t BB = disagg_q::Q16::block_bytes(k);
  auto qs16 = torch::zeros({G * NB * BB}, torch::TensorOptions().dtype(torch::kUInt8));
  auto d16 = torch::zeros({G, ND, 16}, torch::TensorOptions().dtype(torch::kHalf));
  torch::Tensor m16 = with_min ? torch::zeros({G, NB, 16}, torch::TensorOptions().dtype(torch::kHalf))
                      : paired ? torch::zeros({G, NB, 32}, torch::TensorOptions().dtype(m.scalar_type()))
                               : torch::empty({0}, torch::TensorOptions().dtype(torch::kHalf));
  uint8_t* out = qs16.data_ptr<uint8_t>();
  at::Half* dout = d16.data_ptr<at::Half>();
  at::Half* mout = with_min ? m16.data_ptr<at::Half>() : nullptr;
  uint8_t* scout = paired ? static_cast<uint8_t*>(m16.data_ptr()) : nullptr;
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = 0; j < 16 && g * 16 + j < N; ++j) {
        const int64_t n = g * 16 + j;
        const uint8_t* src = qsrc + n * row_bytes;
        for (int64_t e = 0; e < ND; ++e) dout[(g * ND + e) * 16 + j] = dsrc[n * ND + e];
        for (int64_t b = 0; b < NB; ++b) {
          uint8_t* blk = out + (g * NB + b) * BB;
          if (mout != nullptr) mout[(g * NB + b) * 16 + j] = msrc[n * NB + b];
          if (scout != nullptr)
            for (int64_t half = 0; half < 2; ++half)
              scout[(g * NB + b) * 32 + half * 16 + j] = scsrc[n * NB * 2 + 2 * b + half];
          if (crumbs) {  // element e's low 2 bits at bits 2 (e / 8) of byte e % 8; Q3_K's 3rd at bit e of h's 4 bytes
            const uint8_t* hb = three ? hsrc + n * (K / 8) + b * 4 : nullptr;
            for (int64_t v = 0; v < 8; ++v)
              for (int64_t i = 0; i < 4; ++i) {
                const int64_t e = 8 * (v / 2) + 4 * (v % 2) + i, jb = j * 4 + i;
                const int low = (src[b * 8 + e % 8] >> (2 * (e / 8))) & 3;
                blk[64 * (v / 4) + jb] |= static_cast<uint8_t>(low << (2 * (v % 4)));
                if (hb != nullptr && ((hb[e / 8] >> (e % 8)) & 1))
                  blk[128 + 8 * v + jb / 8] |= static_cast<uint8_t>(1u << (jb % 8));
              }
          } else if (kind == Q8_0) {
            for (int64_t c = 0; c < 8; ++c)
              for (int64_t i = 0; i < 4; ++i) {
                blk[c * 64 + j * 4 + i] = src[b * BLOCK + 4 * c + i];  // (-128 too: AVX2 takes |w| as u8)
              }
          } else {
            auto nib = [&](int64_t e) -> uint8_t {  // element e of the block (GGUF order)
              const uint8_t byte = src[b * BLOCK / 2 + (e % 16)];
              return e < 16 ? (byte & 0x0F) : (byte >> 4);
            };
            for (int64_t c = 0; c < 4; ++c)
              for (int64_t i = 0; i < 4; ++i)
                blk[c * 64 + j * 4 + i] = static_cast<uint8_t>(nib(8 * c + i) | (nib(8 * c + 4 + i) << 4));
            // vector v = 2c + half's byte j * 4 + i is element 8c + 4 half + i (in h, a block's 4 * planes bytes hold
            // element e's bits above the nibble at bits e * planes ...); Q5: bit j * 4 + i of word v; Q6_K: bits
            // 2 (v % 4) of byte j * 4 + i of crumb chunk v / 4
            if (planes > 0) {
              const uint8_t* hb = hsrc + n * (K / 8 * planes) + b * 4 * planes;
              for (int64_t v = 0; v < 8; ++v)
                for (int64_t i = 0; i < 4; ++i) {
                  const int64_t e = 8 * (v / 2) + 4 * (v % 2) + i, bit = e * planes, jb = j * 4 + i;
                  const int top = (hb[bit / 8] >> (bit % 8)) & ((1 << planes) - 1);
                  if (six)
                    blk[256 + 64 * (v / 4) + jb] |= static_cast<uint8_t>(top << (2 * (v % 4)));
                  else if (top != 0)
                    blk[256 + 8 * v + jb / 8] |= static_cast<uint8_t>(1u << (jb % 8));
                }
            }
          }
        }
      }
  });
  return {qs16, d16, m16};
}

struct QuantizedAct {
  torch::Tensor q, dx, s, dxs, slo, dxlo;
  disagg_q::ActQ8 view() const {
    disagg_q::ActQ8 a;
    a.q = q.data_ptr<int8_t>();
    a.dx = dx.data_ptr<float>();
    a.s = s.data_ptr<int32_t>();
    a.dxs = dxs.data_ptr<float>();
    a.slo = slo.data_ptr<int32_t>();
    a.dxlo = dxlo.data_ptr<float>();
    a.K = q.size(1);
    return a;
  }
};

// x [R, K] quantized per 32-block; with `residual`, 2R rows: x's, then each row's rounding residual x - dx * q
// quantized in turn (gemm_q8's precise).
QuantizedAct quantize(const torch::Tensor& x, bool residual = false) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % BLOCK == 0, "activations must be [R, K] with K a multiple of 32");
  torch::Tensor xf = x.to(torch::kFloat).contiguous();
  if (residual) xf = torch::cat({xf, torch::empty_like(xf)});
  const int64_t R = xf.size(0), K = xf.size(1), NB = K / BLOCK;
  QuantizedAct a{torch::empty({R, K}, torch::TensorOptions().dtype(torch::kChar)),
                 torch::empty({R, NB}, torch::TensorOptions().dtype(torch::kFloat)),
                 torch::empty({R, NB}, torch::TensorOptions().dtype(torch::kInt)),
                 torch::empty({R, NB}, torch::TensorOptions().dtype(torch::kFloat)),
                 torch::empty({R, NB}, torch::TensorOptions().dtype(torch::kInt)),
                 torch::empty({R, NB}, torch::TensorOptions().dtype(torch::kFloat))};
  float* xp = xf.data_ptr<float>();
  int8_t* q = a.q.data_ptr<int8_t>();
  float* dx = a.dx.data_ptr<float>();
  int32_t* s = a.s.data_ptr<int32_t>();
  float* dxs = a.dxs.data_ptr<float>();
  int32_t* slo = a.slo.data_ptr<int32_t>();
  float* dxlo = a.dxlo.data_ptr<float>();
  const int64_t first = residual ? R / 2 : R;  // rows of x
  at::parallel_for(0, first, 4, [&](int64_t r0, int64_t r1) {
    disagg_q::quantize_rows(xp, r0, r1, K, q, dx, s, dxs, slo, dxlo);
    if (!residual) return;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < K; ++k)
        xp[(first + r) * K + k] = xp[r * K + k] - static_cast<float>(q[r * K + k]) * dx[r * NB + k / BLOCK];
    disagg_q::quantize_rows(xp, first + r0, first + r1, K, q, dx, s, dxs, slo, dxlo);
  });
  return a;
}

std::vector<torch::Tensor> quantize_act(torch::Tensor x) {
  const QuantizedAct a = quantize(x);
  return {a.q, a.dx, a.s};
}

// precise: each row twice, the second time its quantization's residual (x - dx * q, quantized again), and the two
// results summed: the activations' rounding error shrinks ~250-fold for twice the dot products in one pass over
// the weight (the lm_head's choice: at a few rows it reads the weight at the memory's pace either way).
torch::Tensor gemm_q8(torch::Tensor x, int64_t kind, torch::Tensor qs16, torch::Tensor d16, torch::Tensor m16, int64_t N,
                      torch::Tensor bias, bool precise) {
  const disagg_q::Q16 w = q16_of(kind, qs16, d16, m16, N);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "gemm_q8 takes x [R, ", w.K, "]");
  const auto out_dtype = x.scalar_type();
  TORCH_CHECK(out_dtype == torch::kFloat || out_dtype == torch::kBFloat16, "gemm_q8 takes fp32 or bf16 x");
  const int64_t R = x.size(0);
  const QuantizedAct a = quantize(x, precise);
  const disagg_q::ActQ8 av = a.view();
  const int64_t RR = a.q.size(0);
  auto y = torch::empty({RR, N}, torch::TensorOptions().dtype(torch::kFloat));
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.numel() == N, "bias must be [N]");
    bf = bias.to(torch::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.groups(), 4, [&](int64_t g0, int64_t g1) {
    disagg_q::gemm_groups(w, av, RR, g0, g1, yp, N, nullptr);
    if (bp != nullptr || precise)  // the residual rows' outputs added to their rows', then the bias: per group
      for (int64_t r = 0; r < R; ++r)
        for (int64_t n = g0 * disagg_q::GROUP; n < std::min(g1 * disagg_q::GROUP, N); ++n)
          yp[r * N + n] += (precise ? yp[(R + r) * N + n] : 0.0f) + (bp != nullptr ? bp[n] : 0.0f);
  });
  if (precise) y = y.narrow(0, 0, R);
  return out_dtype == torch::kFloat ? y : y.to(out_dtype);
}

// Rows `ids` of a repacked weight, dequantised (fp32): the embedding lookup of a table kept as stored, and
// (all rows) the prefill path's dense tiles.
void dequant_row(const disagg_q::Q16& w, int64_t n, float* out) {
  const int64_t NB = w.NB(), BB = disagg_q::Q16::block_bytes(w.kind), g = n / 16, j = n % 16;
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* blk = w.qs + (g * NB + b) * BB;
    const float d = disagg_q::fp16_to_float(w.d[(g * w.d_blocks() + disagg_q::d_entry(w.kind, b)) * 16 + j]);
    float* o = out + b * BLOCK;
    if (w.kind == Q8_0) {
      for (int64_t c = 0; c < 8; ++c)
        for (int64_t i = 0; i < 4; ++i) o[4 * c + i] = d * static_cast<float>(static_cast<int8_t>(blk[c * 64 + j * 4 + i]));
    } else {  // as gguf: Q4_0 d (q - 8), Q5_0 d (q - 16), Q4_1 / Q5_1 d q + m, Q6_K (d sc) (q - 32),
              // Q3_K (d sc) (q - 4), Q4_K / Q5_K / Q2_K (d sc) q - dmin mn, IQ4_NL d value[q]
      const bool with_min = disagg_q::has_min(w.kind);
      float scale = d, mn = 0.0f;
      if (disagg_q::two_level(w.kind)) {
        const uint8_t* k8 = reinterpret_cast<const uint8_t*>(w.m) + (g * NB + b) * 32 + j;
        const int64_t di = (g * w.d_blocks() + disagg_q::d_entry(w.kind, b)) * 16 + j;
        scale = d * static_cast<float>(k8[0]);
        mn = -(disagg_q::fp16_to_float(w.d[di + 16]) * static_cast<float>(k8[16]));
      } else if (with_min) {
        mn = disagg_q::fp16_to_float(w.m[(g * NB + b) * 16 + j]);
      }
      const int offset =
          w.kind == Q4_0 ? -8 : (w.kind == Q5_0 ? -16 : (w.kind == Q6_K ? -32 : (w.kind == Q3_K ? -4 : 0)));
      const int8_t* sc = reinterpret_cast<const int8_t*>(w.m) + (g * NB + b) * 32 + j;  // Q6_K / Q3_K only
      auto value = [&](int q, int64_t e) {
        if (w.kind == Q2_K) {  // the half's byte: scale (low nibble), minimum (high)
          const auto byte = static_cast<uint8_t>(sc[e < 16 ? 0 : 16]);
          const int64_t di = (g * w.d_blocks() + disagg_q::d_entry(w.kind, b)) * 16 + j;
          const float dmin = disagg_q::fp16_to_float(w.d[di + 16]);
          return (d * static_cast<float>(byte & 0x0F)) * static_cast<float>(q) - dmin * static_cast<float>(byte >> 4);
        }
        if (disagg_q::sub_scales(w.kind))
          return (d * static_cast<float>(sc[e < 16 ? 0 : 16])) * static_cast<float>(q + offset);
        if (w.kind == disagg_q::IQ4_NL) return d * static_cast<float>(disagg_q::IQ4_NL_VALUES[q]);
        return with_min ? scale * static_cast<float>(q) + mn : d * static_cast<float>(q + offset);
      };
      for (int64_t c = 0; c < 4; ++c)
        for (int64_t i = 0; i < 4; ++i) {
          const int jb = static_cast<int>(j * 4 + i);
          o[8 * c + i] = value(disagg_q::quant_at(w.kind, blk, static_cast<int>(2 * c), jb), 8 * c + i);
          o[8 * c + 4 + i] = value(disagg_q::quant_at(w.kind, blk, static_cast<int>(2 * c + 1), jb), 8 * c + 4 + i);
        }
    }
  }
}

torch::Tensor rows_q16(int64_t kind, torch::Tensor qs16, torch::Tensor d16, torch::Tensor m16, int64_t N,
                       torch::Tensor ids) {
  const disagg_q::Q16 w = q16_of(kind, qs16, d16, m16, N);
  const bool all = !ids.defined() || ids.numel() == 0;
  torch::Tensor idx = all ? torch::Tensor() : ids.to(torch::kLong).contiguous();
  const int64_t T = all ? N : idx.numel();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < (all ? 0 : T); ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "row ", ip[t], " outside [0, ", N, ")");
  auto out = torch::empty({T, w.K}, torch::TensorOptions().dtype(torch::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) dequant_row(w, all ? t : ip[t], op + t * w.K);
  });
  return out;
}

}  // namespace

void register_gemm_quant(pybind11::module& m) {
  m.def("repack_q16", &repack_q16, "packed weight -> groups of 16 interleaved outputs for the integer kernels");
  m.def("quantize_act", &quantize_act, "activations -> int8 per 32-block (q, dx, s)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gemm_q8", &gemm_q8, "integer GEMM: repacked weight x activations quantized per 32-block",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rows_q16", &rows_q16, "rows of a repacked weight (all if ids is empty), dequantised to fp32");
  m.def("i8_path", []() { return std::string(disagg_q::i8_path()); }, "the instruction set of the integer kernels");
}
