// A whole decode step of a Llama-family model (grouped-query attention, SiLU-gated MLP, pre-norm) in one
// call, with no Python and no ATen op between the layers' pieces: the CPU engine's decode-only steps
// (torch_engine/fused_step.py says which steps and models).
//
// Per layer, for B rows (one token each): RMSNorm -> quantize -> QKV (integer GEMM, qgemm.h) -> per
// (row, KV head) job: q / k norms (Qwen3), rotary embedding, the new K / V written into the row's page,
// paged attention over the sequence (attention.h) -> quantize -> O, added to the residual -> the layer's
// progress counter bumped -> RMSNorm -> quantize -> gate_up -> SiLU(gate) * up, quantized -> down, added to
// the residual. Then the final RMSNorm. The residual stream and every activation are fp32; K / V are stored
// in the pool's dtype (fp32 or bf16). Dense weights instead (every GEMM of the model held one way): bf16 ones
// (CPUs with AVX-512 BF16) take each GEMM's input rows rounded to bf16 where the others are quantized, and
// bf16gemm.h's GEMM over the weight packed for vdpbf16ps (gemm_bf16.cpp's layout); fp32 ones (any CPU: an
// fp32 engine of an HF checkpoint, an AVX2 CPU's `auto`) take the rows as they are and f32gemm.h's GEMM over
// the model's own [N, K] weight.
//
// Threads: one OpenMP parallel region for the whole step (at::get_num_threads() threads). GEMMs split their
// groups of 16 outputs, attention its (row, KV head) jobs, norms and quantization their rows or blocks;
// a barrier between dependent pieces (8 a layer). Nothing inside the region can throw: every input is
// checked before it.
//
//   FusedDecoder(hidden, heads, kv_heads, head_dim, intermediate, eps, page_size, strides [page, head, kv,
//                token], cos [positions, head_dim / 2], sin, final_norm [hidden], counts [layers] int64)
//   add_layer(norms [attn, mlp, q_norm or empty, k_norm or empty], linears 4 x [qs16, d16, m16, bias]
//             (dense bf16: [packed [N/16, K/2, 16, 2], -, -, bias], fp32: [W [N, K], -, -, bias]),
//             kinds [4] (dense bf16: -1, fp32: -2), outputs [4], pool)
//                                                                 (qkv, o, gate_up, down)
//   run(h [B, hidden], positions [B], page_table [B, M], kv_lens [B]) -> [B, hidden] fp32

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention.h"
#include "bf16gemm.h"
#include "f32gemm.h"
#include "qgemm.h"
#include "rows.h"

namespace {

using disagg_q::ActQ8;
using disagg_q::BLOCK;
using disagg_q::Q16;
using disagg_q::share;
using disagg_rows::rope;

// Chunks of 16 tokens in a part of a sequence's attention (one job): about 8 parts a sequence, of 2 to 8
// chunks (32-128 tokens), so that a short sequence at batch 1 still splits evenly over the threads (parts
// of 128 tokens left one of two threads a 34-token part against 256 at 290 tokens of context); set by the
// sequence's own length only, so its result depends neither on the thread count nor on the batch.
inline int64_t part_chunks(int64_t chunks) { return std::clamp<int64_t>(chunks / 8, 2, 8); }

// How a model's GEMM weights are held (every GEMM of a step the same way).
enum class Weights { PACKED, BF16, F32 };

struct Lin {
  Q16 w;                                 // N and K set for dense weights too
  const at::BFloat16* dense = nullptr;   // a dense weight packed for vdpbf16ps (else w holds the integer one)
  const float* dense32 = nullptr;        // a dense fp32 weight as the model holds it, [N, K]
  std::vector<torch::Tensor> keep;       // the tensors w / dense point into
  const float* bias = nullptr;
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm, q_norm, k_norm;  // fp32; q / k norms may be undefined
  Lin qkv, o, gate_up, down;
  torch::Tensor pool;
};

// x [H] -> out [H]: x / rms(x) * w (fp32).
inline void rms_norm(const float* x, const float* w, float* out, int64_t H, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = x[i] * inv * w[i];
}

inline float inv_rms(const float* x, int64_t H, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  return 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
}

class FusedDecoder {
 public:
  FusedDecoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               int64_t page_size, std::vector<int64_t> strides, torch::Tensor cos, torch::Tensor sin,
               torch::Tensor final_norm, torch::Tensor counts)
      : H_(hidden), HQ_(heads), HKV_(kv_heads), D_(head_dim), I_(intermediate), eps_(static_cast<float>(eps)),
        P_(page_size) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of KV heads");
    TORCH_CHECK(head_dim % 2 == 0, "the rotary embedding needs an even head size");
    TORCH_CHECK(hidden % BLOCK == 0 && intermediate % BLOCK == 0 && (heads * head_dim) % BLOCK == 0,
                "hidden, intermediate and attention widths must be multiples of 32");
    TORCH_CHECK(strides.size() == 4, "strides: page, head, kv, token");
    page_stride_ = strides[0];
    head_stride_ = strides[1];
    kv_stride_ = strides[2];
    token_stride_ = strides[3];
    TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.dim() == 2 && cos.size(1) == head_dim / 2 &&
                    cos.sizes() == sin.sizes(),
                "cos / sin must be fp32 [positions, head_dim / 2]");
    cos_ = cos.contiguous();
    sin_ = sin.contiguous();
    final_norm_ = final_norm.to(torch::kFloat).contiguous();
    TORCH_CHECK(final_norm_.numel() == hidden, "final norm must be [hidden]");
    TORCH_CHECK(counts.scalar_type() == torch::kLong && counts.is_contiguous(), "counts must be int64");
    counts_ = counts;
  }

  void add_layer(std::vector<torch::Tensor> norms, std::vector<std::vector<torch::Tensor>> linears,
                 std::vector<int64_t> kinds, std::vector<int64_t> outputs, torch::Tensor pool) {
    TORCH_CHECK(norms.size() == 4 && linears.size() == 4 && kinds.size() == 4 && outputs.size() == 4,
                "a layer has 4 norms (attn, mlp, q, k) and 4 linears (qkv, o, gate_up, down)");
    TORCH_CHECK(static_cast<int64_t>(layers_.size()) < counts_.numel(), "more layers than progress counters");
    Layer l;
    auto norm = [&](const torch::Tensor& t, int64_t n) -> torch::Tensor {
      if (!t.defined() || t.numel() == 0) return torch::Tensor();
      TORCH_CHECK(t.numel() == n, "a norm weight of ", t.numel(), " values where ", n, " are needed");
      return t.to(torch::kFloat).contiguous();
    };
    l.attn_norm = norm(norms[0], H_);
    l.mlp_norm = norm(norms[1], H_);
    l.q_norm = norm(norms[2], D_);
    l.k_norm = norm(norms[3], D_);
    TORCH_CHECK(l.attn_norm.defined() && l.mlp_norm.defined(), "attention and MLP norms are required");
    TORCH_CHECK(l.q_norm.defined() == l.k_norm.defined(), "q and k norms come together");
    const int64_t qkv_n = (HQ_ + 2 * HKV_) * D_;
    const int64_t want_n[4] = {qkv_n, H_, 2 * I_, H_};
    const int64_t want_k[4] = {H_, HQ_ * D_, H_, I_};
    Lin* dst[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(linears[i].size() == 4, "a linear is [qs16, d16, m16, bias]");
      TORCH_CHECK(outputs[i] == want_n[i], "linear ", i, " has ", outputs[i], " outputs, not ", want_n[i]);
      *dst[i] = make_lin(kinds[i], linears[i], outputs[i]);
      TORCH_CHECK(dst[i]->w.K == want_k[i], "linear ", i, " takes ", dst[i]->w.K, " inputs, not ", want_k[i]);
      const Weights held = dst[i]->dense != nullptr ? Weights::BF16 : dst[i]->dense32 != nullptr ? Weights::F32
                                                                                                  : Weights::PACKED;
      TORCH_CHECK(layers_.empty() && i == 0 ? true : held == weights_,
                  "every GEMM weight held one way: packed as stored, dense bf16 or dense fp32");
      weights_ = held;
    }
    TORCH_CHECK(pool.is_contiguous() && (pool.scalar_type() == torch::kFloat || pool.scalar_type() == torch::kBFloat16),
                "the KV pool must be contiguous fp32 or bf16");
    TORCH_CHECK(pool.stride(0) == page_stride_, "the pool's page stride differs from the one given");
    TORCH_CHECK(layers_.empty() || pool.scalar_type() == layers_[0].pool.scalar_type(), "pools of one dtype");
    l.pool = pool;
    layers_.push_back(std::move(l));
  }

  torch::Tensor run(torch::Tensor h, torch::Tensor positions, torch::Tensor table, torch::Tensor kv_lens) {
    TORCH_CHECK(!layers_.empty(), "no layers added");
    TORCH_CHECK(h.dim() == 2 && h.size(1) == H_, "h must be [B, ", H_, "]");
    const int64_t B = h.size(0);
    TORCH_CHECK(B > 0, "an empty step");
    positions = positions.to(torch::kLong).contiguous();
    table = table.to(torch::kLong).contiguous();
    kv_lens = kv_lens.to(torch::kLong).contiguous();
    TORCH_CHECK(positions.numel() == B && kv_lens.numel() == B && table.dim() == 2 && table.size(0) == B,
                "one position, KV length and page-table row per row");
    const int64_t M = table.size(1), num_pages = layers_[0].pool.size(0);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* tab = table.data_ptr<int64_t>();
    const int64_t* lens = kv_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pos[b] >= 0 && pos[b] < cos_.size(0), "position ", pos[b], " outside the rotary table");
      TORCH_CHECK(lens[b] == pos[b] + 1 && lens[b] <= M * P_, "row ", b, ": KV length ", lens[b],
                  " must be its position + 1 and fit its ", M, " pages");
      for (int64_t i = 0; i < (lens[b] + P_ - 1) / P_; ++i)
        TORCH_CHECK(tab[b * M + i] >= 0 && tab[b * M + i] < num_pages, "page ", tab[b * M + i], " outside the pool");
    }
    x_ = h.to(torch::kFloat).contiguous().clone();
    if (layers_[0].pool.scalar_type() == torch::kFloat)
      step<float>(B, pos, tab, M, lens);
    else
      step<at::BFloat16>(B, pos, tab, M, lens);
    return out_;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  static Lin make_lin(int64_t kind, const std::vector<torch::Tensor>& t, int64_t N) {
    if (kind == disagg_bf16::DENSE) return make_dense(t, N);
    if (kind == disagg_f32::DENSE_F32) return make_dense_f32(t, N);
    TORCH_CHECK(disagg_q::known_kind(kind), "unknown quant kind ", kind);
    const torch::Tensor &qs = t[0], &d = t[1], &m = t[2], &bias = t[3];
    TORCH_CHECK(d.dim() == 3 && d.size(2) == disagg_q::GROUP && d.element_size() == 2 && d.is_contiguous(),
                "d16 must be [groups, K/32 (Q6_K / Q3_K: K/256), 16] fp16");
    Lin l;
    l.w.kind = static_cast<disagg_q::Kind>(kind);
    l.w.N = N;
    l.w.K = d.size(1) * disagg_q::scale_span(l.w.kind);
    TORCH_CHECK(l.w.groups() == d.size(0), "N ", N, " does not fit ", d.size(0), " groups");
    TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1 && qs.numel() == l.w.groups() * l.w.group_bytes(),
                "qs16 does not fit d16");
    l.w.qs = static_cast<const uint8_t*>(qs.data_ptr());
    l.w.d = static_cast<const uint16_t*>(d.data_ptr());
    l.keep = {qs, d};
    if (disagg_q::has_min(l.w.kind) || disagg_q::sub_scales(l.w.kind)) {
      TORCH_CHECK(m.defined() && m.is_contiguous() && m.numel() * m.element_size() == l.w.groups() * l.w.NB() * 32,
                  "Q4_1 / Q5_1 need m16 [groups, K/32, 16] fp16, Q6_K / Q3_K / Q2_K [groups, K/32, 32] bytes");
      l.w.m = static_cast<const uint16_t*>(m.data_ptr());
      l.keep.push_back(m);
    }
    add_bias(l, bias, N);
    return l;
  }

  static Lin make_dense(const std::vector<torch::Tensor>& t, int64_t N) {
    TORCH_CHECK(disagg_bf16::supported(), "dense weights in the fused step need AVX-512 BF16, which this build has not");
    const torch::Tensor& w = t[0];
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 4 && w.is_contiguous() && w.size(0) * 16 == N &&
                    w.size(2) == 16 && w.size(3) == 2,
                "a dense weight must be bf16 [N/16, K/2, 16, 2]");
    Lin l;
    l.w.N = N;
    l.w.K = w.size(1) * 2;
    l.dense = w.data_ptr<at::BFloat16>();
    l.keep = {w};
    add_bias(l, t[3], N);
    return l;
  }

  static Lin make_dense_f32(const std::vector<torch::Tensor>& t, int64_t N) {
    const torch::Tensor& w = t[0];
    TORCH_CHECK(w.scalar_type() == torch::kFloat && w.dim() == 2 && w.is_contiguous() && w.size(0) == N &&
                    N % 16 == 0 && w.size(1) % BLOCK == 0,
                "a dense fp32 weight must be contiguous [N, K], N a multiple of 16 and K of 32");
    Lin l;
    l.w.N = N;
    l.w.K = w.size(1);
    l.dense32 = w.data_ptr<float>();
    l.keep = {w};
    add_bias(l, t[3], N);
    return l;
  }

  static void add_bias(Lin& l, const torch::Tensor& bias, int64_t N) {
    if (bias.defined() && bias.numel() > 0) {
      TORCH_CHECK(bias.numel() == N, "bias must be [N]");
      torch::Tensor b = bias.to(torch::kFloat).contiguous();
      l.bias = b.data_ptr<float>();
      l.keep.push_back(b);
    }
  }

  template <typename T>
  void step(int64_t B, const int64_t* pos, const int64_t* tab, int64_t M, const int64_t* lens) {
    const int64_t H = H_, D = D_, G = HQ_ / HKV_, QKV = (HQ_ + 2 * HKV_) * D, A = HQ_ * D, I = I_;
    const int64_t widest = std::max({H, A, I});
    auto f32 = torch::TensorOptions().dtype(torch::kFloat);
    torch::Tensor xn = torch::empty({B, H}, f32), qkv = torch::empty({B, QKV}, f32), att = torch::empty({B, A}, f32),
                  gu = torch::empty({B, 2 * I}, f32), mid = torch::empty({B, I}, f32);
    torch::Tensor aq = torch::empty({B * widest}, torch::TensorOptions().dtype(torch::kChar));
    torch::Tensor adx = torch::empty({B * widest / BLOCK}, f32);
    torch::Tensor as = torch::empty({B * widest / BLOCK}, torch::TensorOptions().dtype(torch::kInt));
    torch::Tensor adxs = torch::empty({B * widest / BLOCK}, f32);
    torch::Tensor aslo = torch::empty({B * widest / BLOCK}, torch::TensorOptions().dtype(torch::kInt));
    torch::Tensor adxlo = torch::empty({B * widest / BLOCK}, f32);
    const Weights held = weights_;
    torch::Tensor abf = torch::empty({held == Weights::BF16 ? B * widest : 0}, torch::TensorOptions().dtype(torch::kBFloat16));
    torch::Tensor af = torch::empty({held == Weights::F32 ? B * widest : 0}, f32);
    out_ = torch::empty({B, H}, f32);
    float *x = x_.data_ptr<float>(), *xnp = xn.data_ptr<float>(), *qkvp = qkv.data_ptr<float>(),
          *attp = att.data_ptr<float>(), *gup = gu.data_ptr<float>(), *midp = mid.data_ptr<float>(),
          *outp = out_.data_ptr<float>();
    int8_t* q8 = aq.data_ptr<int8_t>();
    float* dx = adx.data_ptr<float>();
    int32_t* sq = as.data_ptr<int32_t>();
    float* dxs = adxs.data_ptr<float>();
    int32_t* slo = aslo.data_ptr<int32_t>();
    float* dxlo = adxlo.data_ptr<float>();
    at::BFloat16* xb = abf.data_ptr<at::BFloat16>();
    float* xf = af.data_ptr<float>();
    auto act = [&](int64_t K) {
      ActQ8 a;
      a.q = q8;
      a.dx = dx;
      a.s = sq;
      a.dxs = dxs;
      a.slo = slo;
      a.dxlo = dxlo;
      a.K = K;
      return a;
    };
    // one 32-block (index k) of row r of a GEMM's K-wide input, made the GEMM's activations: quantized,
    // rounded to bf16 for a dense bf16 weight, as is for a dense fp32 one
    auto prep = [&](const float* src, int64_t r, int64_t K, int64_t blk, int64_t k) {
      if (held == Weights::BF16) {
        at::BFloat16* o = xb + r * K + blk * BLOCK;
        for (int64_t i = 0; i < BLOCK; ++i) o[i] = static_cast<at::BFloat16>(src[i]);
      } else if (held == Weights::F32) {
        std::copy(src, src + BLOCK, xf + r * K + blk * BLOCK);
      } else {
        disagg_q::quantize_block(src, q8 + r * K + blk * BLOCK, dx + k, sq + k, dxs + k, slo + k, dxlo + k);
      }
    };
    auto gemm = [&](const Lin& l, int64_t g0, int64_t g1, float* y, int64_t ldy, bool accumulate) {
      if (held == Weights::BF16)
        disagg_bf16::gemm_groups(l.dense, l.w.K, xb, B, g0, g1, y, ldy, l.bias, accumulate);
      else if (held == Weights::F32)
        disagg_f32::gemm_groups(l.dense32, l.w.K, xf, B, g0, g1, y, ldy, l.bias, accumulate);
      else
        disagg_q::gemm_groups(l.w, act(l.w.K), B, g0, g1, y, ldy, l.bias, accumulate);
    };
    const float* cosp = cos_.data_ptr<float>();
    const float* sinp = sin_.data_ptr<float>();
    int64_t* counts = counts_.data_ptr<int64_t>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const int threads = std::max(1, at::get_num_threads());
    const auto attend = D == 64 ? disagg_attn::attend_range<T, 64>
                                : (D == 128 ? disagg_attn::attend_range<T, 128> : disagg_attn::attend_range<T, 0>);
    // bf16 pages with whole 32-value blocks a head (AVX-512): each row's query prepared once (in the rotary
    // phase) for all its parts, whose accumulators stay in split order until merged (attention.h)
    const bool split = std::is_same_v<T, at::BFloat16> && D % 32 == 0 && disagg_attn::AVX512;
    torch::Tensor qprep = torch::empty({split ? B * A * 2 : 0}, f32);  // [B, A] split + [B, A] as bf16 hi / lo pairs
    float* qsp = qprep.data_ptr<float>();
    uint16_t* qhlp = reinterpret_cast<uint16_t*>(qsp + B * A);
    // attention jobs: each sequence in parts of part_chunks() chunks (so that one long sequence keeps every
    // thread busy), whatever the thread count (so that the result does not depend on it)
    std::vector<int64_t> first_job(B + 1, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t chunks = (lens[b] + disagg_attn::CHUNK - 1) / disagg_attn::CHUNK;
      first_job[b + 1] = first_job[b] + (chunks + part_chunks(chunks) - 1) / part_chunks(chunks);
    }
    std::vector<int64_t> job_row(first_job[B]);
    for (int64_t b = 0; b < B; ++b) std::fill(job_row.begin() + first_job[b], job_row.begin() + first_job[b + 1], b);
    // jobs to threads by their tokens (a sequence's last part is short): thread t of n takes the jobs whose
    // chunks start in [t / n, (t + 1) / n) of all the step's chunks
    std::vector<int64_t> starts;  // chunks before each job
    int64_t total_chunks = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t chunks = (lens[b] + disagg_attn::CHUNK - 1) / disagg_attn::CHUNK;
      for (int64_t c = 0; c < chunks; c += part_chunks(chunks)) starts.push_back(total_chunks + c);
      total_chunks += chunks;
    }
    auto job_at = [&](int th, int n) -> int64_t {  // the first job of thread th of n
      return std::lower_bound(starts.begin(), starts.end(), 0, [&](int64_t start, int) {
               return start * n < static_cast<int64_t>(th) * total_chunks;
             }) - starts.begin();
    };
    const int64_t PART = A + 2 * HQ_;
    torch::Tensor parts = torch::empty({first_job[B] * PART}, f32);
    float* partp = parts.data_ptr<float>();

    // RMSNorm of x's rows, quantized for the next GEMM: a (row, block) at a time, so that one row keeps every
    // thread busy (each thread recomputes the norms of the rows it touches: H multiply-adds)
    auto norm_quantize = [&](const float* xs, const float* w, float* out, int64_t rows, int t, int nt) {
      const int64_t NBH = H / BLOCK;
      const auto [k0, k1] = share(rows * NBH, t, nt);
      int64_t row = -1;
      float inv = 0.0f;
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t r = k / NBH, blk = k % NBH;
        if (r != row) {
          row = r;
          inv = inv_rms(xs + r * H, H, eps_);
        }
        const float* xr = xs + r * H + blk * BLOCK;
        float* o = out + r * H + blk * BLOCK;
        for (int64_t i = 0; i < BLOCK; ++i) o[i] = xr[i] * inv * w[blk * BLOCK + i];
        prep(o, r, H, blk, k);
      }
    };

#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      std::vector<float> scratch(disagg_attn::scratch_floats(D, HQ_)), unsplit_buf(D);
      const auto [r0, r1] = share(B, t, nt);
      for (size_t li = 0; li < layers_.size(); ++li) {
        const Layer& L = layers_[li];
        // RMSNorm, quantized for QKV
        norm_quantize(x, L.attn_norm.data_ptr<float>(), xnp, B, t, nt);
#pragma omp barrier
        {
          const auto [g0, g1] = share(L.qkv.w.groups(), t, nt);
          gemm(L.qkv, g0, g1, qkvp, QKV, false);
        }
#pragma omp barrier
        // norms, rotary and the KV write: one (row, KV head) at a time
        {
          const auto [j0, j1] = share(B * HKV_, t, nt);
          T* pool = L.pool.data_ptr<T>();
          for (int64_t j = j0; j < j1; ++j) {
            const int64_t b = j / HKV_, hk = j % HKV_, p = pos[b];
            float* qh = qkvp + b * QKV + hk * G * D;
            float* kh = qkvp + b * QKV + A + hk * D;
            const float* vh = qkvp + b * QKV + A + HKV_ * D + hk * D;
            if (L.q_norm.defined()) {
              for (int64_t g = 0; g < G; ++g) rms_norm(qh + g * D, L.q_norm.data_ptr<float>(), qh + g * D, D, eps_);
              rms_norm(kh, L.k_norm.data_ptr<float>(), kh, D, eps_);
            }
            const float* c = cosp + p * (D / 2);
            const float* s = sinp + p * (D / 2);
            for (int64_t g = 0; g < G; ++g) {
              rope(qh + g * D, c, s, D);
              for (int64_t d = 0; d < D; ++d) qh[g * D + d] *= scale;
            }
            rope(kh, c, s, D);
            if (split) disagg_attn::prepare_query(qh, G, D, qsp + b * A + hk * G * D, qhlp + b * 2 * A + hk * G * 2 * D);
            T* slot = pool + tab[b * M + p / P_] * page_stride_ + hk * head_stride_ + (p % P_) * token_stride_;
            for (int64_t d = 0; d < D; ++d) {
              slot[d] = static_cast<T>(kh[d]);
              slot[kv_stride_ + d] = static_cast<T>(vh[d]);
            }
          }
        }
#pragma omp barrier
        // attention: (row, part of the sequence) jobs, every KV head in each (its pages read in address order)
        {
          const T* pool = L.pool.data_ptr<T>();
          for (int64_t j = job_at(t, nt); j < job_at(t + 1, nt); ++j) {
            const int64_t b = job_row[j], pc = part_chunks((lens[b] + disagg_attn::CHUNK - 1) / disagg_attn::CHUNK);
            const int64_t c0 = (j - first_job[b]) * pc, t0 = c0 * disagg_attn::CHUNK;
            const int64_t t1 = std::min((c0 + pc) * disagg_attn::CHUNK, lens[b]);
            float* part = partp + j * PART;
            std::fill(part, part + A, 0.0f);
            std::fill(part + A, part + A + HQ_, -std::numeric_limits<float>::infinity());
            std::fill(part + A + HQ_, part + PART, 0.0f);
            if (split)
              attend_prepared(qsp + b * A, qhlp + b * 2 * A, pool, tab + b * M, t0, t1, lens[b], part, scratch.data());
            else
              attend(qkvp + b * QKV, pool, HKV_, head_stride_, tab + b * M, t0, t1, G, D, P_, page_stride_, kv_stride_,
                     token_stride_, part, part + A, part + A + HQ_, scratch.data());
          }
        }
#pragma omp barrier
        {  // the parts combined and quantized for O: a (row, query head) at a time where heads are whole blocks
          const int64_t per = D % BLOCK == 0 ? HQ_ : 1, hs = HQ_ / per;  // items per row, heads per item
          const auto [i0, i1] = share(B * per, t, nt);
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t r = i / per, h0 = (i % per) * hs;
            disagg_attn::merge(partp + first_job[r] * PART, first_job[r + 1] - first_job[r], PART, HQ_, D,
                               attp + r * A, h0, h0 + hs);
            for (int64_t h = h0; split && h < h0 + hs; ++h) {  // the heads back from split order
              float* head = attp + r * A + h * D;
              std::copy(head, head + D, unsplit_buf.begin());
              disagg_attn::unsplit(unsplit_buf.data(), head, D);
            }
            const int64_t NBA = A / BLOCK;
            for (int64_t blk = h0 * D / BLOCK; blk < (h0 + hs) * D / BLOCK; ++blk) {
              const int64_t k = r * NBA + blk;
              prep(attp + r * A + blk * BLOCK, r, A, blk, k);
            }
          }
        }
#pragma omp barrier
        {
          const auto [g0, g1] = share(L.o.w.groups(), t, nt);
          gemm(L.o, g0, g1, x, H, true);
        }
#pragma omp barrier
        if (t == 0) __atomic_store_n(&counts[li], counts[li] + 1, __ATOMIC_RELEASE);  // this layer's KV is written
        norm_quantize(x, L.mlp_norm.data_ptr<float>(), xnp, B, t, nt);
#pragma omp barrier
        {
          const auto [g0, g1] = share(L.gate_up.w.groups(), t, nt);
          gemm(L.gate_up, g0, g1, gup, 2 * I, false);
        }
#pragma omp barrier
        {  // SiLU(gate) * up, quantized a block at a time
          const int64_t NBI = I / BLOCK;
          const auto [k0, k1] = share(B * NBI, t, nt);
          for (int64_t k = k0; k < k1; ++k) {
            const int64_t r = k / NBI, blk = k % NBI;
            const float* gate = gup + r * 2 * I + blk * BLOCK;
            const float* up = gate + I;
            float* m = midp + r * I + blk * BLOCK;
            disagg_rows::silu_mul(gate, up, m, BLOCK);
            const int64_t i = r * NBI + blk;
            prep(m, r, I, blk, i);
          }
        }
#pragma omp barrier
        {
          const auto [g0, g1] = share(L.down.w.groups(), t, nt);
          gemm(L.down, g0, g1, x, H, true);
        }
#pragma omp barrier
      }
      for (int64_t r = r0; r < r1; ++r) rms_norm(x + r * H, final_norm_.data_ptr<float>(), outp + r * H, H, eps_);
    }
  }

  // One part of a row's attention on the split path (attention.h's attend_split) from its prepared query;
  // part: the accumulators (split order), m and l. T is the pool's dtype (only bf16 takes this path).
  template <typename T>
  void attend_prepared(const float* qsplit, const uint16_t* qhl, const T* pool, const int64_t* row, int64_t t0,
                       int64_t t1, int64_t len, float* part, float* scratch) const {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const int64_t G = HQ_ / HKV_, A = HQ_ * D_;
      const auto fn = D_ == 64    ? disagg_attn::attend_split<64>
                      : D_ == 128 ? disagg_attn::attend_split<128>
                                  : disagg_attn::attend_split<0>;
      fn(qsplit, qhl, pool, HKV_, head_stride_, row, t0, t1, len, G, D_, P_, page_stride_, kv_stride_, token_stride_,
         part, part + A, part + A + HQ_, scratch);
      return;
    }
#endif
    (void)qsplit, (void)qhl, (void)pool, (void)row, (void)t0, (void)t1, (void)len, (void)part, (void)scratch;  // unused
  }

  int64_t H_, HQ_, HKV_, D_, I_;
  float eps_;
  Weights weights_ = Weights::PACKED;  // how every GEMM weight of the model is held
  int64_t P_, page_stride_ = 0, head_stride_ = 0, kv_stride_ = 0, token_stride_ = 0;
  torch::Tensor cos_, sin_, final_norm_, counts_, x_, out_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_step(pybind11::module& m) {
  pybind11::class_<FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t, std::vector<int64_t>,
                          torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>())
      .def("add_layer", &FusedDecoder::add_layer)
      .def("run", &FusedDecoder::run, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("num_layers", &FusedDecoder::num_layers);
}
