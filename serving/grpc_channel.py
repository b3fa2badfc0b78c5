"""The gRPC channel of the project's own Triton clients: the router's clients of its decode groups, a decode
leader's clients of its prefill groups, the launcher's demo, `bench serve`'s and the deployment test harness's
(tests that play a user's client open tritonclient's defaults, as a user would).

tritonclient's own defaults (message size limits, keepalive), with subchannels of its own
(``grpc.use_local_subchannel_pool``). By default gRPC shares one connection per address among all channels of
a process, and with it the reconnect back-off a dead peer left behind: a call that found the port closed while
a group was down puts that address in back-off, and a client opened *after* the group was restarted on the
same ports then fails at once with "failed to connect to all addresses ... Connection refused" until the
back-off runs out, though the group serves again. Each client connects for itself.
"""

from __future__ import annotations

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE as _MAX_MESSAGE
from tritonclient.grpc import KeepAliveOptions


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's default channel options (``InferenceServerClient``), plus a subchannel pool of its own."""
    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(keepalive.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.use_local_subchannel_pool", 1),
    ]


def aio_client(url: str) -> aioclient.InferenceServerClient:
    """An asyncio Triton gRPC client of ``url`` (``host:port``), bound to the running event loop."""
    return aioclient.InferenceServerClient(url, channel_args=channel_args())


def sync_client(url: str) -> grpcclient.InferenceServerClient:
    """A thread-based Triton gRPC client of ``url`` (``host:port``)."""
    return grpcclient.InferenceServerClient(url, channel_args=channel_args())
