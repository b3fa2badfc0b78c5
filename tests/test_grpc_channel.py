"""A Triton gRPC client of ours finds a peer that went away and came back on the same port (a restarted
group): a client opened after the restart works at once, though another client of the process found the port
closed meanwhile.

The peer is a gRPC server that answers Triton's ``ServerLive`` (tritonclient's own messages), stopped and
started again in this process on one port."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from orchestrator.triton import free_port
from serving.grpc_channel import aio_client, channel_args

LIVE = "/inference.GRPCInferenceService/ServerLive"


class _Live(grpc.GenericRpcHandler):
    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method != LIVE:
            return None
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: service_pb2.ServerLiveResponse(live=True),
            request_deserializer=service_pb2.ServerLiveRequest.FromString,
            response_serializer=service_pb2.ServerLiveResponse.SerializeToString,
        )


class Peer:
    """A ``ServerLive`` server on one port that can be stopped and started again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server: grpc.Server | None = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((_Live(),))
        assert self.server.add_insecure_port(self.url) == self.port
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    p.start()
    try:
        yield p
    finally:
        p.stop()


def test_a_client_opened_after_a_restart_connects_though_another_found_the_port_closed(peer: Peer) -> None:
    """The first client stays open (a router's client of the group, say) and saw the port closed; a second
    client, opened once the peer serves again, must connect at once."""

    async def scenario() -> tuple[str, bool]:
        first = aio_client(peer.url)
        try:
            assert await first.is_server_live()
            peer.stop()
            with pytest.raises(InferenceServerException) as refused:
                await first.is_server_live()  # this address is now in reconnect back-off
            peer.start()
            second = aio_client(peer.url)
            try:
                return str(refused.value), bool(await second.is_server_live())
            finally:
                await second.close()
        finally:
            await first.close()

    refused, live = asyncio.run(scenario())
    assert "failed to connect" in refused.lower()
    assert live  # with gRPC's shared subchannels: "failed to connect" until the first client's back-off ends


def test_the_channel_keeps_tritonclients_defaults() -> None:
    args = dict(channel_args())
    assert args["grpc.max_receive_message_length"] == args["grpc.max_send_message_length"] == 2**31 - 1
    assert args["grpc.keepalive_timeout_ms"] == 20000 and args["grpc.use_local_subchannel_pool"] == 1
