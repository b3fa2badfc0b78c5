"""The two deployments a serving benchmark compares on equal hardware, through the launcher:
colocated = two single-core replicas (chunked prefill on, clients round-robin); disaggregated =
one prefill and one decode process, one core each. One torch thread per process in both."""

from __future__ import annotations

from pathlib import Path

from orchestrator.cluster import ClusterConfig
from orchestrator.launch import Launch
from serving.ports import free_port
from torch_engine.config import Role

MODES = ("colocated", "disaggregated")


def deployment(
    mode: str,
    engine_dir: Path,
    out: Path,
    chunk: int,
    cores: list[int],
    layers_per_post: int = 1,
    run_dtype: str = "auto",
) -> ClusterConfig:
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
