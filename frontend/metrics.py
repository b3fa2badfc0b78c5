"""The router's Prometheus metrics, as its clients see them (``GET /metrics``)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from frontend.groups import GroupPool

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, pool: GroupPool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "disagg_router_requests", "Requests by route and HTTP status", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "disagg_router_time_to_first_token_seconds", "Request received -> first text", buckets=BUCKETS, registry=r
        )
        self.itl = Histogram(
            "disagg_router_inter_token_latency_seconds", "Between consecutive text pieces", buckets=BUCKETS, registry=r
        )
        self.tokens = Counter(
            "disagg_router_tokens",
            "Tokens by kind (prompt, prompt_cached: of them, reused from a prefix cache; completion)",
            ["kind"],
            registry=r,
        )
        self.in_flight = Gauge("disagg_router_in_flight", "Requests in flight per decode group", ["group"], registry=r)
        self.outstanding = Gauge(
            "disagg_router_outstanding_tokens", "Outstanding tokens per decode group", ["group"], registry=r
        )
        self.up = Gauge("disagg_router_group_up", "1 when the decode group is in rotation", ["group"], registry=r)
        self.retries = Counter("disagg_router_retries", "Requests retried on another group", registry=r)
        self.served = Counter("disagg_router_served", "Requests sent to each decode group", ["group"], registry=r)

    def render(self) -> bytes:
        for g in self.pool.groups:
            self.in_flight.labels(g.name).set(g.in_flight)
            self.outstanding.labels(g.name).set(g.outstanding)
            self.up.labels(g.name).set(1 if g.up else 0)
        return generate_latest(self.registry)


ROUTES = frozenset(
    (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    )
)
MODEL_ROUTE = "/v1/models/{model}"


def route_of(request: web.Request) -> str:
    """The metrics label of a request's route: one of ours, or "other" (a client-chosen path must not
    make a new series: the label set stays bounded)."""
    if request.path.startswith("/v1/models/") and request.path.count("/") == 3:
        return MODEL_ROUTE
    return request.path if request.path in ROUTES else "other"
