"""Plans and their goodput: the search ``disagg plan`` runs (DistServe's placement search, in small).

For a device budget and the TP sizes allowed per role, every colocated plan (``N / tp`` replicas)
and every disaggregated split (``P`` prefill and ``D`` decode instances of their TP sizes, within
the budget) is simulated; its goodput is the highest Poisson rate at which >= 90 % of requests
meet both SLOs (exponential search, then bisection, each rate one simulation of the same seeded
requests), reported per device. The best plan of each mode is then run at its goodput for the
percentiles and for where the time goes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner.simulator import Deployment, SimResult, Simulator
from planner.workload import SLO, Workload

ATTAINMENT = 0.9


@dataclass(frozen=True, slots=True)
class Evaluated:
    label: str
    deployment: Deployment
    goodput: float  # req/s
    at_goodput: SimResult | None  # the simulation at that rate

    @property
    def per_device(self) -> float:
        return self.goodput / self.deployment.devices


def simulate(dep: Deployment, wl: Workload, rate: float, bound_s: float | None = None, seed: int = 0) -> SimResult:
    arrivals = wl.arrivals(rate, seed)
    if bound_s is None:
        c = dep.decode.costs
        alone = c.prefill_s(int(wl.mean_input)) + wl.mean_output * c.decode_s(1, wl.mean_input + wl.mean_output / 2)
        bound_s = arrivals[-1] + 30 * alone
    return Simulator(dep).run(wl.requests, arrivals, rate, bound_s)


def goodput(dep: Deployment, wl: Workload, slo: SLO, iters: int = 10, seed: int = 0) -> tuple[float, SimResult | None]:
    """The highest rate with >= 90 % of requests inside both SLOs (0 if even a trickle misses)."""

    def ok(rate: float) -> SimResult | None:
        res = simulate(dep, wl, rate, seed=seed)
        return res if res.attainment(slo) >= ATTAINMENT else None

    c = dep.decode.costs
    alone = c.prefill_s(int(wl.mean_input)) + wl.mean_output * c.decode_s(1, wl.mean_input)
    lo_rate = 0.02 / alone  # a trickle: one request every 50 request-lengths
    lo = ok(lo_rate)
    if lo is None:
        return 0.0, None
    rate = max(lo_rate * 8, dep.decode.instances / alone)
    best, best_res = lo_rate, lo
    hi = None
    for _ in range(30):  # exponential search for a failing rate
        res = ok(rate)
        if res is None:
            hi = rate
            break
        best, best_res = rate, res
        rate *= 2
    if hi is None:
        return best, best_res
    for _ in range(iters):
        mid = (best + hi) / 2
        res = ok(mid)
        if res is None:
            hi = mid
        else:
            best, best_res = mid, res
    return best, best_res


def search(
    candidates: list[tuple[str, Deployment]],
    wl: Workload,
    slo: SLO,
    progress: Callable[[Evaluated], None] | None = None,
) -> list[Evaluated]:
    out = []
    for label, dep in candidates:
        g, res = goodput(dep, wl, slo)
        ev = Evaluated(label, dep, g, res)
        out.append(ev)
        if progress is not None:
            progress(ev)
    return sorted(out, key=lambda e: -e.per_device)
