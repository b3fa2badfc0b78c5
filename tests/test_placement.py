"""Multi-host and GPU placement, rendered (nothing is started): hosts by name or packed, each rank's
address, ports per host, CUDA_VISIBLE_DEVICES per rank, NCCL's device, and placements that cannot
work refused with the reason."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from orchestrator.cluster import ClusterConfig, ConfigError, Device
from orchestrator.launch import Launch
from serving.node_config import NodeConfig
from torch_engine.config import DType, Role

HOSTS = [
    {"name": "hostA", "address": "10.9.0.1", "slots": 2, "cores": [4, 5]},
    {"name": "hostB", "address": "10.9.0.2", "slots": 4, "gpus": [2, 3, 5]},
    {"name": "hostC", "address": "10.9.0.3"},
]


def config(tmp: Path, engine_dir: Path, **fields: object) -> ClusterConfig:
    raw: dict[str, object] = {
        "hosts": HOSTS,
        "prefill": {"count": 2, "tp": 1, "engine_dir": str(engine_dir), "hosts": ["hostA", "hostC"]},
        "decode": {"count": 1, "tp": 2, "engine_dir": str(engine_dir), "device": "cuda", "hosts": ["hostB"]},
        "run_dir": str(tmp / "run"),
        "engine_cache": str(tmp / "engines"),
        "router": {"enabled": False},
    }
    return ClusterConfig.parse(raw | fields)


def test_ranks_go_where_the_config_says_and_advertise_their_hosts(tiny_engine_dir, tmp_path: Path) -> None:
    cfg = config(tmp_path, tiny_engine_dir("llama", 2), prefill={
        "count": 2, "tp": 1, "engine_dir": str(tiny_engine_dir("llama", 1)), "hosts": ["hostA", "hostC"]})  # fmt: skip
    slots = cfg.rank_map()
    assert [(s.name, s.host.name if s.host else None, s.gpu, s.core) for s in slots] == [
        ("decode0.tp0", "hostB", 2, None), ("decode0.tp1", "hostB", 3, None),
        ("prefill0.tp0", "hostA", None, 4), ("prefill1.tp0", "hostC", None, None),
    ]  # fmt: skip
    launch = Launch(cfg)
    prepared = launch.prepare(progress=False)
    script = "".join(job.script.read_text() for job in launch.jobs.values())  # one mpirun job per group
    assert "--hostfile" in script
    assert (launch.run_dir / "hostfile").read_text().split("\n")[:3] == [
        "hostA slots=1",
        "hostB slots=2",
        "hostC slots=1",
    ]
    assert "--host hostB env DISAGG_NODE_CONFIG=" in script and "CUDA_VISIBLE_DEVICES=2 " in script
    assert "CUDA_VISIBLE_DEVICES=3 " in script and "taskset -c 4 " in script
    nodes = {p.stem: NodeConfig.load(p) for p in (launch.run_dir / "nodes").glob("*.yaml")}
    assert nodes["decode0.tp0"].host == "10.9.0.2" and nodes["decode0.tp0"].grpc_url == "10.9.0.2:8001"
    assert nodes["decode0.tp1"].engine.device == "cuda" and nodes["prefill0.tp0"].engine.device == "cpu"
    assert nodes["prefill1.tp0"].host == "10.9.0.3"
    assert "--grpc-address=10.9.0.1" in script and "--http-address=10.9.0.3" in script  # each binds its own
    # ports: the first decode leader takes the configured ones; the others count per host
    ports = {ld.slot.name: (ld.address, ld.ports.grpc) for ld in prepared.leaders}
    assert ports == {"decode0.tp0": ("10.9.0.2", 8001), "prefill0.tp0": ("10.9.0.1", 20001),
                     "prefill1.tp0": ("10.9.0.3", 20001)}  # fmt: skip
    assert launch.auth_key is not None  # off loopback: locked down by default
    assert yaml.safe_load((launch.run_dir / "endpoints.json").read_text())["prefill1"]["address"] == "10.9.0.3"


def test_groups_without_a_host_are_packed_and_one_host_means_loopback(tiny_engine_dir, tmp_path: Path) -> None:
    d = str(tiny_engine_dir("llama"))
    cfg = ClusterConfig.parse({
        "hosts": [{"name": "a", "address": "10.9.0.1", "slots": 3}, {"name": "b", "address": "10.9.0.2"}],
        "prefill": {"count": 2, "tp": 2, "engine_dir": d}, "decode": {"count": 1, "engine_dir": d}})  # fmt: skip
    assert [s.host.name for s in cfg.rank_map() if s.host] == ["a", "a", "a", "b", "b"]  # a is full after 3
    assert cfg.multi_host
    one = ClusterConfig.parse({"hosts": [{"name": "a", "address": "10.9.0.1"}],
                               "prefill": {"engine_dir": d}, "decode": {"engine_dir": d},
                               "run_dir": str(tmp_path / "run"), "router": {"enabled": False}})  # fmt: skip
    assert not one.multi_host
    launch = Launch(one)
    launch.prepare(progress=False)
    nodes = [NodeConfig.load(p) for p in (launch.run_dir / "nodes").glob("*.yaml")]
    assert {n.host for n in nodes} == {"127.0.0.1"} and launch.auth_key is None  # the whole deployment on one host


def test_binding_every_interface_is_said_and_warned(tiny_engine_dir, tmp_path: Path, caplog) -> None:
    d = str(tiny_engine_dir("llama"))
    cfg = ClusterConfig.parse({"bind": "0.0.0.0", "prefill": {"engine_dir": d}, "decode": {"engine_dir": d},
                               "run_dir": str(tmp_path / "run"), "router": {"enabled": False}})  # fmt: skip
    launch = Launch(cfg)
    with caplog.at_level(logging.WARNING):
        prepared = launch.prepare(progress=False)
    assert "bind 0.0.0.0" in caplog.text
    assert "--grpc-address=0.0.0.0" in "".join(job.script.read_text() for job in launch.jobs.values())
    assert all(ld.address == "127.0.0.1" for ld in prepared.leaders)  # advertised: a reachable address
    assert launch.auth_key is not None  # not loopback: locked down


def test_a_router_reachable_off_loopback_needs_its_key(tiny_engine_dir) -> None:
    d = str(tiny_engine_dir("llama"))
    base = {"bind": "0.0.0.0", "prefill": {"engine_dir": d}, "decode": {"engine_dir": d}}
    with pytest.raises(ConfigError, match=r"router.api_key is needed: the router listens on 0.0.0.0"):
        ClusterConfig.parse(base)
    assert ClusterConfig.parse(base | {"router": {"api_key": "k"}}).router.api_key == "k"
    assert not ClusterConfig.parse(base | {"security": {"restrict": "off"}}).restricted  # open, on purpose
    assert ClusterConfig.parse(base | {"bind": "127.0.0.1"}).router.api_key is None  # loopback: no key needed


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"decode": {"count": 1, "tp": 4, "device": "cuda", "hosts": ["hostB"]}},
            "does not fit on host 'hostB': 3 free GPUs",
        ),
        ({"decode": {"count": 1, "hosts": ["hostZ"]}}, "unknown host 'hostZ'"),
        ({"decode": {"count": 2, "hosts": ["hostA"]}}, "decode.hosts names 1 hosts for 2 groups"),
        ({"hosts": HOSTS[:2], "prefill": {"count": 1, "tp": 5}}, "fits on no single host and tp_across_hosts is off"),
        ({"hosts": ["node1 slots=2"]}, "a hostfile line like 'node1 slots=2' does not say which address"),
        ({"hosts": [HOSTS[0], HOSTS[0]]}, "names must differ"),
    ],
)
def test_placements_that_cannot_work_are_refused_by_name(fields: dict, problem: str) -> None:
    raw: dict[str, object] = {"hosts": HOSTS, "router": {"enabled": False}} | fields
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        ClusterConfig.parse(raw)


def test_tp_may_span_hosts_when_allowed() -> None:
    cfg = ClusterConfig.parse({"hosts": HOSTS[:2], "prefill": {"count": 1, "tp": 5}, "tp_across_hosts": True})
    prefill = [s for s in cfg.rank_map() if s.role is Role.PREFILL]
    assert [s.host.name for s in prefill if s.host] == [
        "hostA",
        "hostB",
        "hostB",
        "hostB",
        "hostB",
    ]  # the decode rank took one of A's 2 slots
    assert all(s.device is Device.CPU for s in prefill)


def test_the_renderer_is_pure_and_renders_a_restart_at_the_next_generation(tiny_engine_dir, tmp_path: Path) -> None:
    """The plan is data: rendering writes nothing and starts nothing; a group rendered again for a
    restart gets the next generation in its node configs (new agents: its peers connect anew)."""
    from orchestrator.run_plan import Renderer, leader_ports
    from orchestrator.triton import TritonInstall

    d = tiny_engine_dir("llama")
    cfg = ClusterConfig.parse({"prefill": {"count": 2, "engine_dir": str(d)}, "decode": {"engine_dir": str(d)},
                               "run_dir": str(tmp_path / "run"), "router": {"enabled": False}})  # fmt: skip
    leaders = [s for s in cfg.rank_map() if s.is_leader]
    ports = dict(zip([s.mpi_rank for s in leaders], leader_ports(cfg, leaders), strict=True))
    dirs = {Role.DECODE: d, Role.PREFILL: d}
    renderer = Renderer(cfg, tmp_path / "run", "run1", TritonInstall.find(), tmp_path / "b", dirs, ports, None)
    plan = renderer.plan()
    assert not (tmp_path / "run").exists()  # nothing written
    assert list(plan.groups) == ["decode0", "prefill0", "prefill1"]
    assert {g.name: g.script_path.name for g in plan.groups.values()}["prefill1"] == "prefill1.sh"
    assert "decode0.sh &" in plan.launch_script and "prefill1.sh &" in plan.launch_script
    decode = plan.groups["decode0"]
    (node,) = decode.nodes.values()
    assert node.agent_name == "run1-decode0.tp0-g0" and node.peer_groups == [(Role.PREFILL, 0), (Role.PREFILL, 1)]
    assert decode.command[0].endswith("mpirun") and "DISAGG_GROUP=decode0" not in decode.command  # exported
    assert "export DISAGG_GROUP=decode0" in decode.script and "generation 0" in decode.script
    again = renderer.group(decode.slots, 1)
    assert [n.agent_name for n in again.nodes.values()] == ["run1-decode0.tp0-g1"] and "generation 1" in again.script
    assert plan.endpoints()["decode0"] == {"address": "127.0.0.1", "http": 8000, "grpc": 8001, "metrics": 8002,
                                           "models": ["decode"]}  # fmt: skip


def test_the_kv_dtype_reaches_every_engine(tiny_engine_dir, tmp_path: Path) -> None:
    """``kv_dtype`` of the deployment is every engine's, prefill and decode alike (their pages must match to
    cross the split); unset, each engine keeps its pages in its compute dtype."""
    from orchestrator.run_plan import Renderer, leader_ports
    from orchestrator.triton import TritonInstall

    d = tiny_engine_dir("llama")
    for kv, want in (({"kv_dtype": "bfloat16"}, DType.BFLOAT16), ({}, None)):
        cfg = ClusterConfig.parse({"prefill": {"engine_dir": str(d)}, "decode": {"engine_dir": str(d)},
                                   "run_dir": str(tmp_path / "run"), "router": {"enabled": False}, **kv})  # fmt: skip
        leaders = [s for s in cfg.rank_map() if s.is_leader]
        ports = dict(zip([s.mpi_rank for s in leaders], leader_ports(cfg, leaders), strict=True))
        dirs = {Role.DECODE: d, Role.PREFILL: d}
        plan = Renderer(cfg, tmp_path / "run", "run1", TritonInstall.find(), tmp_path / "b", dirs, ports, None).plan()
        engines = [n.engine for g in plan.groups.values() for n in g.nodes.values()]
        assert len(engines) == 2 and all(e.kv_dtype is want for e in engines)
