// A C entry point into torch_engine/csrc/prefill_attention.h for tests/test_attention_paths.py: the causal
// prefill kernel compiled for one instruction-set level (-march=...), run serially on fp32 pages.
#include <cstdint>

#include "../../torch_engine/csrc/prefill_attention.h"

extern "C" {

const char* prefill_path() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(DISAGG_ATTN_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

// A chunk of L query tokens at positions first.. (q [L, Hq, D]) over the sequence's pages (`table`):
// out [L, Hq, D]. Returns 0 where this level has no kernel.
int prefill_f32(const float* q, const float* pool, const int64_t* table, float* out, int64_t L, int64_t first,
                int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t page_stride, int64_t head_stride,
                int64_t kv_stride, int64_t token_stride, float scale) {
#if defined(__AVX512F__) || defined(DISAGG_ATTN_AVX2)
  const auto serial = [](int64_t b, int64_t e, int64_t, const auto& fn) { fn(b, e); };
  disagg_prefill::prefill_kernel<float, float>(q, pool, table, out, L, first, Hq, Hkv, D, P, page_stride, head_stride,
                                        kv_stride, token_stride, scale, serial);
  return 1;
#else
  return 0;
#endif
}
}
