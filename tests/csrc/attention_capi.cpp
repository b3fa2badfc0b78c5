// A C entry point into torch_engine/csrc/attention.h for tests/test_attention_paths.py: the header compiled
// for one instruction-set level (-march=...), called through ctypes on fp32 or bf16 pages.
#include <cstdint>
#include <vector>

#include "../../torch_engine/csrc/attention.h"

// One sequence of n tokens over its pages (`row`), H KV heads of G query heads of size D: out [H * G * D].
template <typename T>
void attend(const float* q, const T* pool, int64_t H, int64_t G, int64_t D, const int64_t* row, int64_t n,
            int64_t P, int64_t page_stride, int64_t head_stride, int64_t kv_stride, int64_t token_stride, float scale,
            float* out) {
  const int64_t Q = H * G;
  std::vector<float> qf(Q * D), acc(Q * D), m(Q), l(Q), scratch(disagg_attn::scratch_floats(D, Q));
  auto job = D == 64 ? disagg_attn::decode_job<float, T, float, 64> : disagg_attn::decode_job<float, T, float, 0>;
  job(q, pool, H, head_stride, row, n, out, G, D, P, page_stride, kv_stride, token_stride, scale, qf.data(), acc.data(),
      m.data(), l.data(), scratch.data());
}

extern "C" {

const char* attn_path() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(DISAGG_ATTN_AVX2)
  return "avx2";
#else
  return "plain";
#endif
}

void attend_f32(const float* q, const float* pool, int64_t H, int64_t G, int64_t D, const int64_t* row, int64_t n,
                int64_t P, int64_t page_stride, int64_t head_stride, int64_t kv_stride, int64_t token_stride,
                float scale, float* out) {
  attend(q, pool, H, G, D, row, n, P, page_stride, head_stride, kv_stride, token_stride, scale, out);
}

// The same over bf16 pages (each value's 16 bits; the fp32 engine of an AVX2-only CPU over EngineConfig.kv_dtype)
void attend_bf16(const float* q, const uint16_t* pool, int64_t H, int64_t G, int64_t D, const int64_t* row, int64_t n,
                 int64_t P, int64_t page_stride, int64_t head_stride, int64_t kv_stride, int64_t token_stride,
                 float scale, float* out) {
  attend(q, reinterpret_cast<const at::BFloat16*>(pool), H, G, D, row, n, P, page_stride, head_stride, kv_stride,
         token_stride, scale, out);
}

// exp of n values by the level's vector exp (exp512 / exp256; std::exp on the plain level)
void exp_f32(const float* x, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, disagg_attn::exp512(_mm512_loadu_ps(x + i)));
#elif defined(DISAGG_ATTN_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, disagg_attn::exp256(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) out[i] = std::exp(x[i]);
}
}
