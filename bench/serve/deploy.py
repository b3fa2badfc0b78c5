"""The two deployments a serving benchmark compares on equal hardware, through the launcher:
colocated = two single-core replicas (chunked prefill on, clients round-robin); disaggregated =
one prefill and one decode process, one core each. One torch thread per process in both."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from orchestrator.cluster import ClusterConfig
from orchestrator.launch import Launch
from planner.placement import PlacementSpec
from serving.ports import free_port
from torch_engine.config import Role

MODES = ("colocated", "disaggregated")


class Frontend(enum.StrEnum):
    """What the load generator talks to: the decode groups' `llm` over Triton gRPC (round-robin), or the router."""

    TRITON = "triton"
    ROUTER = "router"


@dataclass(frozen=True, slots=True)
class Targets:
    frontend: Frontend
    urls: list[str]  # decode groups' gRPC endpoints, or the router's /v1 URL
    model: str  # the router's model name (unused over Triton)
    api_key: str | None = None  # the router's, when it has one


def deployment(
    mode: str,
    engine_dir: Path,
    out: Path,
    chunk: int,
    cores: list[int],
    layers_per_post: int = 1,
    run_dtype: str = "auto",
    frontend: Frontend = Frontend.TRITON,
    placement: PlacementSpec | None = None,
    prefix_cache: bool = True,
    router: dict[str, object] | None = None,
) -> ClusterConfig:
    """``router``: settings of the router's section over the benchmark's own (admission limits)."""
    base: dict[str, object] = {
        "mode": mode,
        "dtype": "float32",
        "run_dtype": run_dtype,
        "threads_per_rank": 1,
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": chunk, "max_prefill_chunk": chunk},
        "ports": {"http": free_port(), "grpc": free_port(), "metrics": free_port()},
        "run_dir": str(out / mode),
        "timeouts": {"startup_s": 300, "kv_transfer_s": 120},
        "transport": {"layers_per_post": layers_per_post},
        "placement": (placement or PlacementSpec()).model_dump(mode="json"),
        "router": {"enabled": frontend is Frontend.ROUTER, "port": free_port(), "probe_interval_s": 0.25}
        | (router or {}),
        "prefix_cache": {"enabled": prefix_cache},
    }
    group = {"tp": 1, "engine_dir": str(engine_dir), "num_pages": 2048}
    if mode == "colocated":
        base |= {"prefill": {"count": 0}, "decode": group | {"count": 2, "cores": cores[:2]}}
    else:
        base |= {
            "prefill": group | {"count": 1, "cores": cores[:1]},
            "decode": group | {"count": 1, "cores": cores[1:2]},
        }
    return ClusterConfig.parse(base, f"bench {mode} deployment")


def decode_urls(launch: Launch) -> list[str]:
    assert launch.prepared is not None
    return [f"{launch.cfg.bind}:{ld.ports.grpc}" for ld in launch.prepared.leaders if ld.slot.role is not Role.PREFILL]


def load_targets(launch: Launch, frontend: Frontend) -> Targets:
    if frontend is Frontend.TRITON:
        return Targets(frontend, decode_urls(launch), "")
    assert launch.prepared is not None and launch.prepared.router_url is not None and launch.router is not None
    router = launch.router.cfg
    return Targets(frontend, [launch.prepared.router_url], router.model_name, router.spec.api_key)
