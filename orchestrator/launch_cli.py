"""``disagg launch CONFIG``: start a deployment, say where it listens, keep it up until Ctrl-C.

With ``--demo PROMPT`` (what ``make serve`` does) one chat prompt goes through the router's OpenAI
API (or, with the router off, the client-facing decode group over Triton gRPC streaming) once
everything is ready, and the answer streams to the terminal with its TTFT and inter-token latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
from pathlib import Path

from orchestrator.client import Completion, chat_via_router, generate
from orchestrator.cluster import ClusterConfig, ConfigError
from orchestrator.launch import Launch, LaunchError
from orchestrator.router_process import served_model_name
from orchestrator.run_plan import RunPlan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, help="cluster config (YAML); see configs/")
    p.add_argument("--run-dir", type=Path, default=None, help="override the config's run_dir")
    p.add_argument("--render-only", action="store_true", help="write the node configs and launch.sh, start nothing")
    p.add_argument("--demo", default=None, help="once ready, stream the answer to this chat prompt")
    p.add_argument("--max-tokens", type=int, default=96)


def _say(msg: str) -> None:
    print(f"[disagg] {msg}", file=sys.stderr, flush=True)


def _describe(cfg: ClusterConfig, prepared: RunPlan) -> None:
    if prepared.router_url is not None:
        key = " (API key required)" if cfg.router.api_key else ""
        _say(f"OpenAI API: {prepared.router_url}{key}  (router over {cfg.decode.count} decode group(s))")
    for name, ep in prepared.endpoints().items():
        if name == "router":
            continue
        assert isinstance(ep, dict)
        _say(
            f"{name}: http {cfg.bind}:{ep['http']}  grpc {cfg.bind}:{ep['grpc']}  "
            f"metrics http://{cfg.bind}:{ep['metrics']}/metrics  models {','.join(ep['models'])}"
        )


def _show(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


async def _demo(cfg: ClusterConfig, prepared: RunPlan, prompt: str, max_tokens: int) -> Completion:
    if prepared.router_url is not None:
        model = served_model_name(cfg.router, cfg.model)
        return await chat_via_router(prepared.router_url, model, prompt, max_tokens, cfg.router.api_key, _show)
    from serving.grpc_channel import aio_client

    client = aio_client(f"{cfg.bind}:{prepared.leaders[0].ports.grpc}")
    try:
        return await generate(client, prompt, max_tokens, "demo", chat=True, on_piece=_show, key=prepared.secret)
    finally:
        await client.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(a: argparse.Namespace) -> int:
    try:
        cfg = ClusterConfig.load(a.config)
    except ConfigError as exc:
        print(f"disagg: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM (kill, docker stop, systemd) both shut down cleanly; a background job
    # of a non-interactive shell starts with SIGINT ignored, so install the handler explicitly
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    launch = Launch(cfg, a.run_dir)
    _say(f"building engines and rendering the deployment in {launch.run_dir}")
    prepared = launch.prepare()
    _say(f"mpirun script: {prepared.script}")
    if a.render_only:
        return 0
    try:
        launch.start()
        _say(f"starting {len(prepared.slots)} ranks: " + "; ".join(s.describe() for s in prepared.slots))
        launch.wait_ready()
        _say("ready")
        _describe(cfg, prepared)
        if a.demo:
            _say(f"> {a.demo}" + (" (through the router)" if prepared.router_url else ""))
            done = asyncio.run(_demo(cfg, prepared, a.demo, a.max_tokens))
            print(flush=True)
            if done.error:
                _say(f"demo request failed: {done.error}")
            elif done.ttft is not None:
                itl = done.itls
                med = f"{1000 * statistics.median(itl):.1f} ms median, {1000 * max(itl):.1f} ms max" if itl else "n/a"
                _say(f"TTFT {1000 * done.ttft:.0f} ms; ITL {med} over {len(done.times)} streamed pieces")
        _say(f"serving; Ctrl-C stops everything (logs in {launch.run_dir / 'logs'})")
        message = launch.supervise()
        if message:
            print(f"disagg: error: {message}", file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        _say("shutting down")
        launch.stop()
        _say("stopped")
        return 0
    except LaunchError as exc:
        launch.stop()
        print(f"disagg: error: {exc}", file=sys.stderr)
        return 1
