"""Typed configuration of the engine: the model's architecture, the build manifest, the runtime.

All three are frozen pydantic models that reject unknown keys. They are loaded once (from
``engine.json`` or the caller) and passed down; nothing below reads the environment.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

TorchDType = torch.dtype
MANIFEST_NAME = "engine.json"
MANIFEST_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WeightStorage(enum.Enum):
    """How an engine directory holds the weights. AS_STORED: a GGUF's block-quantized tensors (Q8_0, Q6_K, Q5_K,
    Q5_1, Q5_0, Q4_K, Q4_1, Q4_0, IQ4_NL, Q3_K) stay packed and the engine computes with them
    (``torch_engine/quant.py``), the rest in
    the engine's dtype; DENSE: every tensor dequantised to the engine's dtype."""

    AS_STORED = "as-stored"
    DENSE = "dense"


class KVLayout(enum.Enum):
    """Order of a KV page's dimensions.

    HND: ``[head, k/v, token, dim]`` per page: one tensor-parallel shard's heads are one
    contiguous byte range of the page, so it moves in one write.
    NHD: ``[token, head, k/v, dim]`` per page: a shard's slice is one range per token.
    """

    HND = "hnd"
    NHD = "nhd"


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    @property
    def torch(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.value]

    @property
    def itemsize(self) -> int:
        return self.torch.itemsize

    @classmethod
    def of(cls, dtype: TorchDType) -> DType:
        return cls(str(dtype).removeprefix("torch."))


class Family(enum.Enum):
    """Model families the engine runs. Qwen2 (q/k/v bias) and Qwen3 (q/k norm) are Llama-style."""

    LLAMA = "llama"
    DEEPSEEK_V2 = "deepseek_v2"
    DEEPSEEK_V3 = "deepseek_v3"


class RopeScaling(_Frozen):
    """RoPE variants. ``default`` is plain RoPE; ``llama3`` and ``yarn`` follow HF semantics."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @model_validator(mode="after")
    def _known(self) -> RopeScaling:
        if self.rope_type not in ("default", "llama3", "yarn"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r} (supported: default, llama3, yarn)")
        return self


class ModelConfig(_Frozen):
    """Architecture of one checkpoint, independent of parallelism."""

    family: Family
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # DeepSeek MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DeepSeek MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    # multi-token prediction (DeepSeek-V3's MTP module, ``models/mtp.py``): extra layers after the last
    num_mtp_layers: int = Field(default=0, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported activation {self.hidden_act!r} (only silu)")
        if self.is_mla:
            if self.qk_rope_head_dim <= 0 or self.v_head_dim <= 0:
                raise ValueError("MLA needs qk_rope_head_dim and v_head_dim > 0")
        elif self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.n_routed_experts:
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise ValueError(f"unsupported MoE scoring function {self.scoring_func!r}")
            if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ValueError(f"unsupported MoE top-k method {self.topk_method!r}")
        return self

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_kv_layers(self) -> int:
        """Layers with KV pages: the decoder's, then the MTP module's."""
        return self.num_layers + self.num_mtp_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % max(self.moe_layer_freq, 1) == 0
        )


class EngineManifest(_Frozen):
    """``engine.json`` in an engine directory, written by ``builders`` and read by the engine."""

    format_version: int = MANIFEST_VERSION
    model: ModelConfig
    role: Role
    tp_size: int = Field(ge=1)
    dtype: DType
    page_size: int = Field(ge=1)
    kv_layout: KVLayout
    source: str
    fingerprint: str
    has_tokenizer: bool = True
    weights: WeightStorage = WeightStorage.DENSE
    # relative RMS error of each build-time change of a weight format ("Q3_K->Q8_0", "dense->Q8_0", ...)
    conversion_error: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def load(cls, engine_dir: Path) -> EngineManifest:
        path = Path(engine_dir) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{engine_dir} is not an engine directory: {MANIFEST_NAME} is missing")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is corrupt: {exc}") from exc
        if data.get("format_version") != MANIFEST_VERSION:
            raise ValueError(
                f"{path} has format version {data.get('format_version')!r}, "
                f"this engine reads {MANIFEST_VERSION}: rebuild it"
            )
        return cls.model_validate(data)

    def save(self, engine_dir: Path) -> None:
        (Path(engine_dir) / MANIFEST_NAME).write_text(self.model_dump_json(indent=2), encoding="utf-8")


class SchedulerConfig(_Frozen):
    """Continuous batching limits (the cluster config's ``scheduler`` section is this model)."""

    max_num_seqs: int = Field(default=32, ge=1, description="requests in one step")
    max_num_batched_tokens: int = Field(default=512, ge=1, description="token budget per step")
    max_prefill_chunk: int = Field(default=512, ge=1, description="chunked prefill: largest chunk of one request")
    head_of_line_steps: int = Field(
        default=100,
        ge=0,
        description="a waiting request refused pages for its next chunk is passed by later ones that fit for this "
        "many steps, then by none (0: strict arrival order)",
    )


class SpecMethod(enum.StrEnum):
    NONE = "none"
    NGRAM = "ngram"  # prompt lookup: drafts are what followed the latest earlier match of the last tokens
    MTP = "mtp"  # the checkpoint's multi-token-prediction module drafts one token from the last hidden state


class SpeculativeConfig(_Frozen):
    """Speculative decoding (``torch_engine/speculative.py``): lossless; ``num_tokens`` is fixed."""

    method: SpecMethod = Field(default=SpecMethod.NONE, description="drafter: none, ngram or mtp")
    num_tokens: int = Field(default=4, ge=1, le=16, description="draft tokens verified per step (at most)")
    ngram_max: int = Field(default=3, ge=1, description="longest suffix the n-gram drafter matches")
    ngram_min: int = Field(default=1, ge=1, description="shortest suffix the n-gram drafter matches")
    default: bool = Field(default=True, description="requests that do not say (speculate unset) speculate")
    max_batch: int | None = Field(
        default=None, ge=1, description="no drafting while more requests than this run (vLLM's disable-by-batch-size)"
    )
    give_up_after: int | None = Field(
        default=4,
        ge=1,
        description="a request whose drafts were wholly rejected this many times in a row stops speculating "
        "(and its MTP work stops); None: it only backs off",
    )

    @model_validator(mode="after")
    def _sizes(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} exceeds ngram_max {self.ngram_max}")
        return self


class PrefixCacheConfig(_Frozen):
    """Automatic prefix caching (``torch_engine/prefix_cache.py``; the cluster config's ``prefix_cache``)."""

    enabled: bool = Field(default=True, description="full KV pages are content-addressed and reused across requests")
    max_cached_pages: int | None = Field(
        default=None,
        ge=0,
        description="most pages that nobody holds kept for their cached prefix (None: every free page may keep one)",
    )


NO_PREFIX_CACHE = PrefixCacheConfig(enabled=False)  # benchmarks: every measured prefill computes its prompt


class EngineConfig(_Frozen):
    """Runtime settings of one engine instance (one TP rank)."""

    engine_dir: Path
    device: str = "cpu"
    dtype: DType | Literal["auto"] | None = None  # None: the manifest's; auto: the fastest native dtype
    # the KV pages' dtype. None: the compute dtype (``dtype``), except under ``auto`` on a CPU that computes in fp32
    # with the compiled kernels (an AVX2-only CPU): bfloat16 there (models.run_kv_dtype), half the KV's bytes —
    # twice the tokens per GiB, half the attention's reads and the wire's bytes (llama.cpp keeps f16)
    kv_dtype: DType | None = None
    page_size: int | None = Field(default=None, ge=1)  # None: the manifest's
    kv_layout: KVLayout | None = None  # None: the manifest's
    num_pages: int = Field(default=512, ge=1)
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    max_model_len: int | None = Field(default=None, ge=2)  # None: the model's max positions
    num_threads: int | None = Field(default=None, ge=1)
    # decode-only steps through static buffers, replayed as CUDA graphs on a GPU. None: on for CUDA
    # (TP 1, models without MoE), off on CPUs (padding to a bucket costs more than launches save there)
    decode_graphs: bool | None = None
    # the CPU serving path: GEMM weights packed once for oneDNN (fp32 / bf16) and the fused paged decode
    # attention kernel (torch_engine/csrc, built by make); the ``auto`` dtype implies it. Off: the reference path
    fast_cpu: bool = False
    # decode-only steps in one compiled call (torch_engine/fused_step.py) on the fast CPU path. None: wherever
    # the model qualifies (Llama-family GQA, TP 1, GEMM weights kept as stored); True: required (an error
    # naming why not); False: the eager model
    fused_decode: bool | None = None
