"""Transports move byte ranges between registered memory of two agents, with notifications."""

from kv_messenger.transport.base import FaultInjector, TransferState, Transport
from kv_messenger.transport.memory import MemoryFabric, MemoryTransport

__all__ = ["FaultInjector", "MemoryFabric", "MemoryTransport", "TransferState", "Transport"]
