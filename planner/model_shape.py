"""What one model costs per token, from its architecture: weights read, FLOPs, KV bytes.

Read from an engine directory (its manifest) or a Hugging Face ``config.json`` (the same import the
builder uses), so that a GPU profile (``planner/gpus.py``) can be derived for a model too large to
run here. MoE models read only the experts their batch routes to: with ``E`` routed experts, ``k``
per token and ``B`` tokens in a step, ``E * (1 - (1 - k/E)^B)`` distinct experts per MoE layer are
expected (uniform routing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from builders.hf_import import config_from_hf
from torch_engine.config import MANIFEST_NAME, EngineManifest, ModelConfig


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    cfg: ModelConfig

    @classmethod
    def load(cls, source: str | Path) -> ModelShape:
        """An engine directory (has ``engine.json``) or a Hugging Face ``config.json`` (or its folder)."""
        path = Path(source)
        if (path / MANIFEST_NAME).is_file():
            m = EngineManifest.load(path)
            return cls(Path(m.source).name, m.model)
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"
        if path.is_file():
            raw = json.loads(path.read_text(encoding="utf-8"))
            name = str(raw.get("_name_or_path") or path.stem)
            return cls(name, config_from_hf(raw, path.parent))
        raise FileNotFoundError(f"{source}: neither an engine directory nor a Hugging Face config.json")

    # -- parameters ----------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        c, h = self.cfg, self.cfg.hidden_size
        if c.is_mla:
            assert c.kv_lora_rank is not None
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            q = h * c.q_lora_rank + c.q_lora_rank * c.num_heads * qk if c.q_lora_rank else h * c.num_heads * qk
            kv_a = h * (c.kv_lora_rank + c.qk_rope_head_dim)
            kv = kv_a + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
            return q + kv + c.num_heads * c.v_head_dim * h
        return h * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)

    @property
    def moe_layers(self) -> int:
        c = self.cfg
        if not c.n_routed_experts:
            return 0
        return sum(1 for i in range(c.first_k_dense_replace, c.num_layers) if i % max(c.moe_layer_freq, 1) == 0)

    @property
    def expert_params(self) -> int:
        return 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size

    @property
    def dense_params(self) -> int:
        """Read by every step whatever its batch: attention, dense MLPs, shared experts, embedding and head."""
        c = self.cfg
        dense_mlp = (c.num_layers - self.moe_layers) * 3 * c.hidden_size * c.intermediate_size
        shared = self.moe_layers * c.n_shared_experts * self.expert_params
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        return c.num_layers * self.attention_params + dense_mlp + shared + embed

    @property
    def total_params(self) -> int:
        return self.dense_params + self.moe_layers * self.cfg.n_routed_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Multiplied per token (FLOPs): the dense part and ``k`` routed experts per MoE layer."""
        return self.dense_params + self.moe_layers * self.cfg.num_experts_per_tok * self.expert_params

    def params_read(self, tokens: int) -> float:
        """Parameters one step over ``tokens`` tokens reads (expected distinct experts)."""
        c = self.cfg
        if not self.moe_layers:
            return float(self.dense_params)
        e, k = c.n_routed_experts, c.num_experts_per_tok
        touched = e * (1.0 - (1.0 - k / e) ** max(tokens, 1))
        return self.dense_params + self.moe_layers * touched * self.expert_params

    # -- per token -------------------------------------------------------------------------
    def kv_elements_per_token(self) -> int:
        c = self.cfg
        if c.is_mla:
            assert c.kv_lora_rank is not None
            return c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim)
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim

    def attention_flops(self, tokens: int, context: float) -> float:
        """Score and value products of ``tokens`` queries over ``context`` keys, every layer."""
        c = self.cfg
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim if c.is_mla else c.head_dim
        v = c.v_head_dim if c.is_mla else c.head_dim
        return 2.0 * tokens * context * c.num_heads * (qk + v) * c.num_layers
