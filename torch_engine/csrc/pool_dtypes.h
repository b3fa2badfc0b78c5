// The dtype pairs of the Python-facing attention and KV-write kernels: the engine's activations (q, qkv) in
// fp32 or bf16 and its KV pool in fp32 or bf16, either with either (an fp32 engine may keep bf16 pages:
// EngineConfig.kv_dtype). with_dtypes() calls fn(Tag<QT>{}, Tag<PT>{}) for the tensors' pair.
#pragma once

#include <torch/extension.h>

namespace disagg_dtypes {

template <typename T>
struct Tag {
  using type = T;
};

// fn(Tag<float>{}) or fn(Tag<at::BFloat16>{}) for t's dtype; another dtype is an error naming `who` and `what`.
template <typename Fn>
void with_type(const torch::Tensor& t, const char* who, const char* what, const Fn& fn) {
  if (t.scalar_type() == torch::kFloat)
    fn(Tag<float>{});
  else if (t.scalar_type() == torch::kBFloat16)
    fn(Tag<at::BFloat16>{});
  else
    TORCH_CHECK(false, who, ": ", what, " must be float32 or bfloat16, got ", t.scalar_type());
}

template <typename Fn>
void with_dtypes(const torch::Tensor& x, const torch::Tensor& pool, const char* who, const Fn& fn) {
  with_type(x, who, "the activations", [&](auto xt) {
    with_type(pool, who, "the KV pool", [&](auto pt) { fn(xt, pt); });
  });
}

}  // namespace disagg_dtypes
