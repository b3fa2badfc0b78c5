"""The deployment key on the inference path, checked by the node itself.

Triton forwards the key's header (``AUTH_HEADER``; gRPC callers may prefix it as Triton's restricted
protocols want, ``GRPC_AUTH_HEADER``) into every request's parameters (``--grpc-header-forward-pattern``
/ ``--http-header-forward-pattern``: ``FORWARD_PATTERN``), and the backend answers a request whose
parameters do not carry the key with ``UNAUTHORIZED`` before it does anything. So the key never has to
be on Triton's command line (where every local user could read it in ``/proc``): the node reads it from
its config file (0600). A Triton ensemble hands the parameters on to its steps; our own BLS calls pass
them (``parameters``).
"""

from __future__ import annotations

import hmac
import json

from serving.node_config import AUTH_HEADER, GRPC_AUTH_HEADER

FORWARD_PATTERN = f"^({GRPC_AUTH_HEADER.removesuffix(AUTH_HEADER)})?{AUTH_HEADER}$"
UNAUTHORIZED = f"unauthorized: this node needs the deployment's key in the '{AUTH_HEADER}' header"
_NAMES = (AUTH_HEADER, GRPC_AUTH_HEADER)


def authorized(parameters: str, key: str) -> bool:
    """Whether a request's parameters (Triton's JSON text) carry ``key`` under the header's name (HTTP
    headers arrive capitalized: names are compared without case)."""
    try:
        given = json.loads(parameters or "{}")
    except json.JSONDecodeError:
        return False
    if not isinstance(given, dict):
        return False
    values = [v for k, v in given.items() if isinstance(k, str) and k.lower() in _NAMES and isinstance(v, str)]
    return any(hmac.compare_digest(v.encode(), key.encode()) for v in values)


def key_parameters(key: str | None) -> dict[str, str]:
    """What a BLS call from inside the node passes on (nothing when the node has no key)."""
    return {AUTH_HEADER: key} if key is not None else {}
