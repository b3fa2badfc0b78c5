"""Shared test helpers: tiny random-weight HF checkpoints and engines built from them."""

from __future__ import annotations

import copy
import itertools
import random
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    LlamaConfig,
    LogitsProcessorList,
    Qwen2Config,
    Qwen3Config,
)

from builders import BuildOptions, build_engine
from kv_messenger.protocol import PrefillRequest
from orchestrator.triton import TritonServer
from planner.profile import DecodeGrid, HardwareProfile, ProfileSource
from serving.kv_links import DecodeLink
from torch_engine.config import (
    DType,
    EngineConfig,
    KVLayout,
    PrefixCacheConfig,
    SchedulerConfig,
    SpecMethod,
    SpeculativeConfig,
)
from torch_engine.connector import Placement, RefusalReason, Refused, Reserved
from torch_engine.engine import LLMEngine
from torch_engine.guided import Guide, GuideKind
from torch_engine.parallel import TPGroup
from torch_engine.request import RequestOutput
from torch_engine.sampling import SamplingParams
from torch_engine.speculator import Speculator
from torch_engine.tokenizer import Tokenizer

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
}

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, **_COMMON),
    "qwen2": lambda: Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **_COMMON),
    "qwen3": lambda: Qwen3Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, **_COMMON
    ),
    "deepseek_v3": lambda: DeepseekV3Config(
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_scaling={  # type: ignore[call-arg]  # accepted by **kwargs, not in its signature
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        **_COMMON,
    ),
    "deepseek_v2": lambda: DeepseekV2Config(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        topk_method="greedy",
        **_COMMON,
    ),
}


def make_tiny_checkpoint(
    kind: str, folder: Path, seed: int = 0, random_biases: bool = False, intermediate_size: int | None = None
) -> tuple[Path, torch.nn.Module]:
    """Save a random tiny model of ``kind`` as an HF folder; returns the folder and the fp32 HF model
    (``random_biases``: Linear biases drawn too — HF's initialisation zeroes them, so a path that dropped
    them would pass; ``intermediate_size``: the MLP's width instead of 128)."""
    torch.manual_seed(seed)
    cfg = TINY_CONFIGS[kind]()
    if intermediate_size is not None:
        cfg.intermediate_size = intermediate_size
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    if random_biases:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
    if hasattr(cfg, "n_routed_experts"):  # give the router's correction bias some weight, as trained models have
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    model.save_pretrained(str(folder))
    return folder, model


def make_mtp_checkpoint(kind: str, folder: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """A tiny random checkpoint of ``kind`` with a DeepSeek-V3-style MTP layer: checkpoint layer
    ``n = num_hidden_layers`` is the MTP block (standard layer tensors) plus ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm`` and copies of the embedding and head, as DeepSeek-V3 ships it.
    Returns the folder and an fp32 HF model with ``n + 1`` layers (its last one is the MTP block:
    the independent reference ``mtp_reference`` runs)."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    cfg = TINY_CONFIGS[kind]()
    n = cfg.num_hidden_layers
    cfg.num_hidden_layers = n + 1
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.1)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    h, p = cfg.hidden_size, f"model.layers.{n}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{p}{norm}.weight"] = 1 + 0.1 * torch.randn(h)
    state[p + "eh_proj.weight"] = torch.randn(h, 2 * h) * 0.1
    state[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[p + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    saved = copy.deepcopy(cfg)  # the model keeps its n + 1 layers
    saved.num_hidden_layers = n
    saved.num_nextn_predict_layers = 1
    saved.save_pretrained(str(folder))
    model.mtp_extra = {k.removeprefix(p): v for k, v in state.items() if k.startswith(p) and "." in k[len(p) :]}
    return folder, model


@torch.no_grad()
def mtp_reference(model: Any, tokens: list[int]) -> list[int]:
    """The MTP module's greedy draft at each position ``i < len(tokens) - 1`` (predicting token
    ``i + 2``), computed with Hugging Face's own decoder layers: the main model's output at ``i``
    (layer ``n - 1``'s output after the final norm) and the embedding of token ``i + 1``, normed,
    concatenated (embedding first), projected by ``eh_proj``, through HF's layer ``n`` (the MTP
    block, fed by a pre-hook), ``shared_head.norm`` and the head."""
    inner: Any = model.model
    n = len(inner.layers) - 1
    extra: dict[str, torch.Tensor] = model.mtp_extra
    eps = model.config.rms_norm_eps

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    ids = torch.tensor([tokens[:-1]])
    seen: dict[str, torch.Tensor] = {}

    def grab(name: str) -> Callable[..., None]:
        def hook(_mod: object, _args: object, out: Any) -> None:
            seen[name] = out[0] if isinstance(out, tuple) else out

        return hook

    handle = inner.layers[n - 1].register_forward_hook(grab("main"))
    model(ids)
    handle.remove()
    main = inner.norm(seen["main"])  # [1, T - 1, H]
    emb = inner.embed_tokens(torch.tensor([tokens[1:]]))
    x = torch.cat((rms(emb, extra["enorm.weight"]), rms(main, extra["hnorm.weight"])), -1) @ extra["eh_proj.weight"].T

    def feed(_mod: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    pre = inner.layers[n].register_forward_pre_hook(feed, with_kwargs=True)
    post = inner.layers[n].register_forward_hook(grab("mtp"))
    model(ids)
    pre.remove()
    post.remove()
    logits = rms(seen["mtp"], extra["shared_head.norm.weight"]) @ extra["shared_head.head.weight"].T
    return logits[0].argmax(-1).tolist()


@dataclass(slots=True)
class EnginePath:
    """Which compute path the tests' engines take: the device (``pytest --device cuda`` on a GPU
    machine), and the serving fast paths (prepared weights, decode graphs) or the reference one."""

    device: str = "cpu"
    fast_cpu: bool = False
    decode_graphs: bool | None = None


PATH = EnginePath()


def engine_config(engine_dir: Path, **settings: Any) -> EngineConfig:
    """``EngineConfig`` on the tests' current engine path (``settings`` win)."""
    path = {"device": PATH.device, "fast_cpu": PATH.fast_cpu, "decode_graphs": PATH.decode_graphs}
    return EngineConfig.model_validate({"engine_dir": engine_dir, **path, **settings})


def tiny_engine(
    engine_dir: Path,
    *,
    page_size: int | None = None,
    layout: KVLayout | None = None,
    num_pages: int = 256,
    chunk: int = 512,
    budget: int = 512,
    max_num_seqs: int = 32,
    tp: TPGroup | None = None,
    speculative: SpeculativeConfig | None = None,
    prefix_cache: bool | int = True,
    tokenizer: bool = False,
    kv_dtype: DType | None = None,
) -> LLMEngine:
    """``prefix_cache``: on, off, or on with at most that many unheld cached pages; ``tokenizer``: load
    the engine directory's tokenizer (text prompts, stop strings, structured output); ``kv_dtype``: the pages'
    dtype (None: the engine's, fp32)."""
    cache = PrefixCacheConfig(
        enabled=prefix_cache is not False,
        max_cached_pages=None if isinstance(prefix_cache, bool) else prefix_cache,
    )
    cfg = engine_config(
        engine_dir,
        page_size=page_size,
        kv_layout=layout,
        num_pages=num_pages,
        scheduler=SchedulerConfig(max_prefill_chunk=chunk, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        dtype=DType.FLOAT32,
        kv_dtype=kv_dtype,
        speculative=speculative or SpeculativeConfig(),
        prefix_cache=cache,
    )
    return LLMEngine(cfg, tp=tp, load_tokenizer=tokenizer)


def build_tiny(folder: Path, out: Path, tp: int = 1, page_size: int = 4) -> Path:
    return build_engine(
        str(folder), out, BuildOptions(tp_size=tp, dtype=DType.FLOAT32, page_size=page_size), progress=False
    )


def generate_staggered(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[RequestOutput]:
    """Each prompt added once the one before it has its first token (``n`` > 1's other choices as the
    router starts them: while the first one runs), then all run to the end; the last output of each."""
    last: dict[str, RequestOutput] = {}
    ids: list[str] = []
    for prompt, sp in zip(prompts, params, strict=True):
        ids.append(engine.add_request(prompt, sp))
        while ids[-1] not in last and engine.has_unfinished():
            last |= {o.request_id: o for o in engine.step()}
    while engine.has_unfinished():
        last |= {o.request_id: o for o in engine.step()}
    for i in ids:
        engine.retire(i)
    return [last[i] for i in ids]


def tp_generate(
    rank: int,
    world: int,
    init_file: str,
    engine_dir: str,
    prompts: list[list[int]],
    max_tokens: int,
    out: str,
    fast_cpu: bool = False,
    speculative: str | None = None,
    guide: tuple[str, str] | None = None,
    staggered: bool = False,
) -> None:
    """Body of one TP rank (spawned): rank 0 generates and writes the tokens as JSON, the others follow
    (``fast_cpu``: on the engine's fast CPU path; ``speculative``: a drafter, e.g. ``mtp``; ``guide``:
    (guided_decoding_guide_type, guide) for every request, the leader loading the tokenizer;
    ``staggered``: each prompt added after the one before it has its first token, ``generate_staggered``)."""
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    PATH.fast_cpu = fast_cpu
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        spec = SpeculativeConfig(method=SpecMethod(speculative), num_tokens=1) if speculative else None
        engine = tiny_engine(Path(engine_dir), tp=TPGroup(rank, world), speculative=spec, tokenizer=guide is not None)
        if rank == 0:
            g = Guide(GuideKind.parse(guide[0]), guide[1]) if guide is not None else None
            sp = SamplingParams(max_tokens=max_tokens, guide=g)
            if staggered:
                outs = generate_staggered(engine, prompts, [sp] * len(prompts))
                tokens, cached = [list(o.output_ids) for o in outs], [o.cached_tokens for o in outs]
            else:
                tokens, cached = engine.generate(prompts, sp), []
            engine.shutdown()
            stats = {"tokens": tokens, "pages_used": engine.page_stats().used, "drafts": engine.spec_stats.proposed,
                     "cached": cached}  # fmt: skip
            Path(out).write_text(json.dumps(stats))
        else:
            engine.run_follower()
    finally:
        dist.destroy_process_group()


def hf_greedy(
    model: torch.nn.Module,
    prompt: list[int],
    n: int,
    processors: LogitsProcessorList | None = None,
) -> tuple[list[int], list[float]]:
    """The HF reference for greedy decoding: `n` tokens (EOS not special) on HF's own KV cache, as its
    ``generate`` decodes, and each token's log-probability. Each step's last logits (fp32) go through
    `processors` (HF logits processors, given the whole sequence so far) before the argmax and the
    log-softmax. One forward a token instead of the whole sequence again: the same fp32 values to ~1e-6."""
    seq, logps = list(prompt), []
    with torch.no_grad():
        out = model(torch.tensor([seq]), use_cache=True)
        for step in range(n):
            scores = out.logits[:, -1].float()
            if processors is not None:
                scores = processors(cast(torch.LongTensor, torch.tensor([seq])), cast(torch.FloatTensor, scores))
            token = int(scores[0].argmax())
            logps.append(float(torch.log_softmax(scores[0], -1)[token]))
            seq.append(token)
            if step + 1 < n:
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return seq[len(prompt) :], logps


def smollm2_prompts(tok: Tokenizer) -> list[list[int]]:
    """The three prompts the SmolLM2 equality checks use (one through the chat template)."""
    return [
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):"),
        tok.encode("Explain in one sentence why the sky is blue.", chat=True),
    ]


_reservations = itertools.count()


def try_reserve(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str | None = None
) -> tuple[str, list[int]] | None:
    """The decode half of a split request on a bare engine (no connector): the engine's admission
    reserves and pins pages for ``prompt[:-1]``; the connector's hold is let go at once, so the pages
    are pinned only until ``kv_ready``. None when the pool has too few free pages now."""
    rid = request_id if request_id is not None else f"kv-{next(_reservations)}"
    adm = engine.admit_for_kv(prompt, params, rid, lambda load, n: Placement.REMOTE)
    if isinstance(adm, Refused) and adm.reason is RefusalReason.NO_ROOM:
        return None
    assert isinstance(adm, Reserved), adm
    engine.unpin_pages(adm.pages)
    return rid, adm.pages


def reserve(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str | None = None
) -> tuple[str, list[int]]:
    got = try_reserve(engine, prompt, params, request_id)
    assert got is not None, "not enough free pages to reserve"
    return got


def copy_pages(dst: LLMEngine, src: LLMEngine, src_pages: list[int], dst_pages: list[int]) -> None:
    """Copy whole pages of every layer between two engines' KV (stands in for the messenger)."""
    assert len(src_pages) == len(dst_pages)
    s, d = torch.tensor(src_pages, dtype=torch.long), torch.tensor(dst_pages, dtype=torch.long)
    for mine, theirs in zip(dst.kv_export().pools, src.kv_export().pools, strict=True):
        mine[d] = theirs[s]


def start_split(
    link: DecodeLink, prompt: list[int], params: SamplingParams, request_id: str, seed: int = 0, meta: bool = False
) -> PrefillRequest:
    """A decode link's request as a decode node starts it: the engine's admission reserves and pins
    its pages, the link takes them over; returns the request to send to the prefill node."""
    adm = link.engine.admit_for_kv(prompt, params, request_id, lambda load, n: Placement.REMOTE)
    assert isinstance(adm, Reserved), adm
    return link.start(adm, prompt, seed, meta)


def prompt_of(length: int, seed: int) -> list[int]:
    """A seeded prompt of token ids in the tiny models' vocabulary (256)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def speculating_engine(
    engine_dir: Path, spec: SpeculativeConfig | None, speculator: Speculator | None = None, **kw: Any
) -> LLMEngine:
    """The speculative-decoding tests' engine: small chunks and budget, fp32; ``spec`` None: no drafting."""
    sched = SchedulerConfig(max_prefill_chunk=16, max_num_batched_tokens=48, max_num_seqs=16)
    settings: dict[str, object] = {"num_pages": 256, "scheduler": sched, "dtype": "float32"}
    if spec is not None:
        settings["speculative"] = spec
    return LLMEngine(engine_config(engine_dir, **settings | kw), load_tokenizer=False, speculator=speculator)


def linear_profile(
    per_token: float = 0.001, base: float = 0.01, per_seq: float = 0.002, per_ctx: float = 1e-6,
    link: float = 1e9, kv: int = 1000,
) -> HardwareProfile:  # fmt: skip
    """prefill(n) = base + n * per_token; decode(b, c) = base + b * per_seq + b * c * per_ctx."""
    tokens = [1, 64, 256, 1024]
    batches, contexts = [1, 4, 16], [64, 1024]
    return HardwareProfile(
        name="synthetic",
        source=ProfileSource.MEASURED,
        model="synthetic",
        prefill=[(n, base + n * per_token) for n in tokens],
        decode=DecodeGrid(
            batches=batches,
            contexts=contexts,
            seconds=[[base + b * per_seq + b * c * per_ctx for c in contexts] for b in batches],
        ),
        kv_bytes_per_token=kv,
        link_bytes_per_s=link,
    )


def metric(srv: TritonServer, name: str, labels: str = "") -> float:
    """One Prometheus sample of a running server (its first line matching ``name`` and ``labels``)."""
    with urllib.request.urlopen(f"http://{srv.host}:{srv.ports.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} not found")


def settled_metric(srv: TritonServer, name: str, labels: str = "", timeout_s: float = 10.0) -> float:
    """``metric`` once two reads 0.3 s apart agree: a decode node sends its per-token metrics every
    100 ms from another thread than the engine's, so they lag its responses by up to that."""
    import time

    deadline = time.monotonic() + timeout_s
    last = metric(srv, name, labels)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = metric(srv, name, labels)
        if now == last:
            return now
        last = now
    raise AssertionError(f"metric {name} {labels} did not settle within {timeout_s:.0f} s")
