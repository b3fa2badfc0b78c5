"""``disagg train-mtp``: train a DeepSeek-V3-style MTP head for a Llama-family checkpoint that has
none (the embedded SmolLM2), by self-distillation on the model's own greedy outputs.

1. **Data.** The engine generates greedy continuations of ``prompts`` (topics x instructions,
   through the chat template); continuations are what the model itself says, so an MTP head that
   predicts them drafts what verification accepts.
2. **Targets.** Hugging Face's Llama runs each sequence once (teacher forcing) for the main model's
   final hidden states (after the final norm, as the engine feeds MTP). The head learns
   ``p(t[i + 2] | h[i], t[i + 1])`` over the continuation positions; the prompt positions only
   give context (the MTP block attends over them) and are not scored.
3. **Head.** ``enorm``, ``hnorm``, ``eh_proj`` (``[embedding ; hidden] -> hidden``) and one decoder
   layer, then ``shared_head.norm`` and the model's own (frozen) output head, as DeepSeek-V3 defines
   MTP. The layer starts as a copy of the model's last layer, ``eh_proj`` as "pass the hidden state
   through", ``shared_head.norm`` as the model's final norm.
4. **Output.** A safetensors file in DeepSeek-V3's names (``model.layers.{n}.*``), attached at build
   time (``disagg build --mtp-head FILE``), and a JSON report next to it: loss and held-out top-1
   accuracy (what greedy verification would accept) before and after training.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from builders.build import DEFAULT_ENGINE_CACHE, BuildOptions, build_engine, default_engine_dir, load_checkpoint
from builders.checkpoint import Checkpoint
from builders.errors import BuildError
from builders.mtp_head import MTP_TENSORS
from torch_engine.config import DType, EngineConfig, Family, SchedulerConfig
from torch_engine.engine import LLMEngine
from torch_engine.sampling import SamplingParams

TOPICS = (
    "the water cycle", "black holes", "photosynthesis", "the French Revolution", "volcanoes", "the immune system",
    "machine learning", "the stock market", "honey bees", "the Roman Empire", "climate change", "electric cars",
    "the human heart", "coffee", "the moon landing", "recycling", "earthquakes", "the internet", "chess",
    "renewable energy", "sleep", "the Great Wall of China", "vaccines", "rainbows", "the printing press",
    "dinosaurs", "tea ceremonies", "solar panels", "the Olympic Games", "penguins", "gravity", "jazz music",
    "sorting algorithms", "binary search", "linked lists", "HTTP requests", "unit testing", "prime numbers",
    "recursion", "hash tables",
)  # fmt: skip
INSTRUCTIONS = (
    "Explain {t} to a ten-year-old.",
    "Write three short paragraphs about {t}.",
    "List five facts about {t}, one per line.",
    "Write a Python function related to {t}, with a docstring.",
    "Summarise what is important about {t}.",
    "Give step-by-step instructions for learning about {t}.",
    "Write a short poem about {t}.",
    "What are common misconceptions about {t}?",
)


@dataclass(slots=True)
class TrainReport:
    source: str
    sequences: int
    train_positions: int
    heldout_positions: int
    steps: int
    seconds: float
    loss_before: float
    loss_after: float
    accuracy_before: float  # held-out top-1: the head's draft equals the model's own next-next token
    accuracy_after: float


class Head(nn.Module):
    """The MTP module in training form (HF's decoder layer, full causal attention, no KV cache)."""

    def __init__(self, hf: Any, layer: nn.Module) -> None:
        super().__init__()
        inner = hf.model
        h = hf.config.hidden_size
        eps = hf.config.rms_norm_eps
        self.enorm = nn.RMSNorm(h, eps=eps)
        self.hnorm = nn.RMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():  # start as "pass the hidden state through", the embedding part small
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, h:].copy_(torch.eye(h))
            self.eh_proj.weight[:, :h].normal_(0.0, 0.02)
        self.layer = layer
        self.norm = nn.RMSNorm(h, eps=eps)
        with torch.no_grad():
            self.norm.weight.copy_(inner.norm.weight)
        self.rotary = inner.rotary_emb
        self.embed = inner.embed_tokens
        self.head = hf.lm_head

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[1, T, H]`` (the model's normed final states at 0..T-1), ``next_ids`` ``[1, T]``
        (tokens 1..T) -> logits ``[1, T, V]`` for tokens 2..T+1."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed(next_ids)), self.hnorm(hidden)), dim=-1))
        t = x.shape[1]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return self.head(self.norm(out[0] if isinstance(out, tuple) else out))


def _hf_llama(ck: Checkpoint) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = ck.config
    if c.family is not Family.LLAMA or c.qk_norm or c.attention_bias:
        raise BuildError("train-mtp trains heads for Llama-architecture checkpoints (SmolLM2, Llama) only")
    settings: dict[str, Any] = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    missing, _ = model.load_state_dict(ck.tensors, strict=False)
    if [m for m in missing if m != "lm_head.weight"]:
        raise BuildError(f"checkpoint {ck.name!r} does not load into a Llama model: missing {missing[:3]}")
    if c.tie_word_embeddings:
        model.tie_weights()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _generate(
    source: str, prompts: list[str] | list[list[int]], max_tokens: int, cache: Path
) -> list[tuple[list[int], int]]:
    """Greedy continuations from the engine: (prompt + continuation token ids, prompt length)."""
    opts = BuildOptions(dtype=DType.FLOAT32)
    engine_dir = build_engine(source, default_engine_dir(cache, source, opts), opts, progress=False)
    sched = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024)
    engine = LLMEngine(EngineConfig(engine_dir=engine_dir, dtype="auto", scheduler=sched, num_pages=2048))
    if prompts and isinstance(prompts[0], str):
        assert engine.tokenizer is not None, f"{source} has no tokenizer"
        ids = [engine.tokenizer.encode(p, chat=True) for p in prompts if isinstance(p, str)]
    else:
        ids = [list(p) for p in prompts if not isinstance(p, str)]
    outs = engine.generate(ids, SamplingParams(max_tokens=max_tokens))
    return [(p + o, len(p)) for p, o in zip(ids, outs, strict=True)]


@torch.no_grad()
def _hidden(hf: Any, seq: list[int]) -> torch.Tensor:
    """The model's final hidden states after its final norm, ``[1, T, H]``."""
    seen: list[torch.Tensor] = []
    handle = hf.model.norm.register_forward_hook(lambda _m, _a, out: seen.append(out))
    hf(torch.tensor([seq]))
    handle.remove()
    return seen[0]


def _loss_acc(head: Head, hidden: torch.Tensor, seq: list[int], start: int) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy over the scored positions (predicting tokens ``start + 2..``), correct top-1, count."""
    ids = torch.tensor([seq])
    logits = head(hidden[:, :-2], ids[:, 1:-1])[0, start:]  # position i predicts token i + 2
    target = ids[0, start + 2 :]
    loss = F.cross_entropy(logits.float(), target, reduction="sum")
    return loss, int((logits.argmax(-1) == target).sum()), len(target)


def train(
    source: str,
    out: Path,
    *,
    prompts: list[str] | list[list[int]] | None = None,
    max_tokens: int = 96,
    epochs: int = 3,
    lr: float = 5e-4,
    heldout: float = 0.1,
    seed: int = 0,
    cache: Path = DEFAULT_ENGINE_CACHE,
    log: bool = True,
) -> TrainReport:
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    ck = load_checkpoint(source)
    hf = _hf_llama(ck)
    n = ck.config.num_layers
    if prompts is None:
        prompts = [i.format(t=t) for t in TOPICS for i in INSTRUCTIONS]
    # scored positions: from prompt length - 2 (its draft is the first generated token) on
    data = [(s, max(k - 2, 0)) for s, k in _generate(source, prompts, max_tokens, cache) if len(s) - k >= 2]
    random.Random(seed).shuffle(data)
    cut = max(1, int(len(data) * heldout))
    test, train_set = data[:cut], data[cut:]
    hidden = {id(s): _hidden(hf, s) for s, _ in data}
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layer = LlamaDecoderLayer(hf.config, n - 1)
    layer.load_state_dict(hf.model.layers[n - 1].state_dict())
    head = Head(hf, layer)
    params = [p for name, p in head.named_parameters() if not name.startswith(("embed", "head"))]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def evaluate() -> tuple[float, float]:
        head.eval()
        total, right, count = 0.0, 0, 0
        with torch.no_grad():
            for s, st in test:
                loss, ok, k = _loss_acc(head, hidden[id(s)], s, st)
                total, right, count = total + float(loss), right + ok, count + k
        head.train()
        return total / max(count, 1), right / max(count, 1)

    loss0, acc0 = evaluate()
    steps = 0
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(train_set)
        for s, st in train_set:
            loss, _, k = _loss_acc(head, hidden[id(s)], s, st)
            opt.zero_grad()
            (loss / k).backward()
            opt.step()
            steps += 1
        if log:
            print(f"epoch {epoch + 1}/{epochs}: held-out loss / top-1 {evaluate()}", flush=True)
    loss1, acc1 = evaluate()
    prefix = f"model.layers.{n}."
    tensors = {prefix + k: v.detach().contiguous() for k, v in layer.state_dict().items()}
    own: dict[str, torch.Tensor] = {"enorm.weight": head.enorm.weight, "hnorm.weight": head.hnorm.weight}
    own |= {"eh_proj.weight": head.eh_proj.weight, "shared_head.norm.weight": head.norm.weight}
    assert set(own) == set(MTP_TENSORS)
    tensors |= {prefix + k: v.detach().contiguous() for k, v in own.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    report = TrainReport(
        source, len(data), sum(len(s) - st - 2 for s, st in train_set), sum(len(s) - st - 2 for s, st in test),
        steps, time.perf_counter() - t0, loss0, loss1, acc0, acc1,
    )  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(asdict(report), indent=2), encoding="utf-8")
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="checkpoint: 'smollm2' (embedded), a .gguf file or an HF folder")
    p.add_argument("--out", type=Path, required=True, help="the head's safetensors file (a .json report beside it)")
    p.add_argument("--max-tokens", type=int, default=96, help="greedy tokens generated per prompt")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--threads", type=int, default=None)


def run(a: argparse.Namespace) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    r = train(a.model, a.out, max_tokens=a.max_tokens, epochs=a.epochs, lr=a.lr)
    print(
        f"{a.out}: {r.sequences} sequences, {r.train_positions} training positions, {r.steps} steps in "
        f"{r.seconds:.0f} s; held-out top-1 {r.accuracy_before:.1%} -> {r.accuracy_after:.1%}, "
        f"loss {r.loss_before:.2f} -> {r.loss_after:.2f}"
    )
    return 0
