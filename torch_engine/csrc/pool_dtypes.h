// The dtype pairs of the Python-facing attention and KV-write kernels: the engine's activations (q, qkv) in
// fp32 or bf16 and its KV pool in fp32 or bf16, either with either (an fp32 engine may keep bf16 pages:
// EngineConfig.kv_dtype). with_dtypes() calls fn(Tag<QT>{}, Tag<PT>{}) for the tensors' pair.
#pragma once

#include <torch/extension.h>

#include <type_traits>

namespace disagg_dtypes {

template <typename T>
struct Tag {
  using type = T;
};

template <typename Fn>
void with_pool(const torch::Tensor& pool, const char* who, const Fn& fn) {
  if (pool.scalar_type() == torch::kFloat)
    fn(Tag<float>{});
  else if (pool.scalar_type() == torch::kBFloat16)
    fn(Tag<at::BFloat16>{});
  else
    TORCH_CHECK(false, who, ": the KV pool must be float32 or bfloat16, got ", pool.scalar_type());
}

template <typename Fn>
void with_dtypes(const torch::Tensor& x, const torch::Tensor& pool, const char* who, const Fn& fn) {
  auto on_pool = [&](auto xt) { with_pool(pool, who, [&](auto pt) { fn(xt, pt); }); };
  if (x.scalar_type() == torch::kFloat)
    on_pool(Tag<float>{});
  else if (x.scalar_type() == torch::kBFloat16)
    on_pool(Tag<at::BFloat16>{});
  else
    TORCH_CHECK(false, who, " supports float32 and bfloat16 activations, got ", x.scalar_type());
}

}  // namespace disagg_dtypes
