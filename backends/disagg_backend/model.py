"""Triton Python-based backend ``disagg_backend``: tensors <-> typed requests, nothing else.

``TritonPythonModel`` reads the model config's ``role`` parameter and hands every call to one
small class per role, each owning its own state:

- ``Preprocessing``: ``text_input`` (+ ``chat``) -> ``input_ids``.
- ``Decode`` (decoupled): parses each request and hands it to the node's ``DecodeLoop`` (the
  engine on its own thread, ``serving.node.decode_loop``), so the stub never blocks on one
  request; a ``_Responder`` per request streams token windows back; Prometheus metrics.
- ``Postprocessing``: a token window -> text (the same no-split rule as the engine loop).
- ``Prefill`` (prefill nodes): ``handshake`` and ``prefill_request`` for the node's
  ``PrefillLoop``; KV transfer metrics.
- ``BatchAdapter`` (decoupled, model ``ensemble``): TensorRT-LLM's batch-dimension shapes over
  ``llm``, through a BLS call per request on its own thread (``serving.batch_adapter``).

Bad input gets a per-request error that names the problem.

Long because: Triton's Python-based backend loads this one file (the directory is copied into the
run's backend folder, not installed), so the role classes, their Prometheus metrics (Triton's
``MetricFamily``) and the response stream live together. Parsing and encoding are
``serving.codecs``', the engine loop and everything else ``serving``'s.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from pydantic import ValidationError

from kv_messenger.prefill_side import PrefillOutcome
from serving import codecs
from serving.auth import UNAUTHORIZED, authorized, key_parameters
from serving.batch_adapter import IGNORED, log_prob_outputs, text_output, unbatch
from serving.codecs import DecodePiece
from serving.decode_loop import DecodeLoop
from serving.kv_events import KVEventLog
from serving.loop import LoopReport
from serving.names import OVERLOADED, BackendRole, Model, Tensor
from serving.node import decode_loop, prefill_loop
from serving.node_config import NODE_CONFIG_ENV, NodeConfig, group_name
from serving.prefill_client import refusal
from serving.request_ids import RequestIds
from serving.trace import Tracer
from serving.wire import Arrays, Getter
from torch_engine.request import FinishReason, RequestOutput
from torch_engine.sampling import InvalidRequestError, TokenLogprobs
from torch_engine.tokenizer import Tokenizer, whole_text, window_text

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
Request = Any  # pb_utils.InferenceRequest (the stub's own type, not importable for annotations)
Response = Any  # pb_utils.InferenceResponse


log = logging.getLogger(__name__)


class TritonPythonModel:
    """One backend, four roles: ``initialize`` picks the role class, the rest delegates to it."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        role = BackendRole(config["parameters"]["role"]["string_value"])
        node = NodeConfig.load(os.environ[NODE_CONFIG_ENV])
        roles: dict[BackendRole, Callable[[NodeConfig], _Role]] = {
            BackendRole.PREPROCESSING: Preprocessing,
            BackendRole.DECODE: Decode,
            BackendRole.PREFILL: Prefill,
            BackendRole.BATCH_ADAPTER: BatchAdapter,
        }
        self.role = roles[role](node)
        self.key = node.auth_key
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))

    def execute(self, requests: list[Request]) -> list[Response] | None:
        """The role's answers; with a deployment key, a request without it is refused first (``serving.auth``)."""
        key = self.key
        refused = {i for i, r in enumerate(requests) if key is not None and not authorized(r.parameters(), key)}
        if not refused:
            return self.role.execute(requests)
        allowed = [r for i, r in enumerate(requests) if i not in refused]
        if self.decoupled:
            for i in sorted(refused):
                requests[i].get_response_sender().send(_error(UNAUTHORIZED), flags=FINAL)
            return self.role.execute(allowed) if allowed else None
        answers = iter(self.role.execute(allowed) or [] if allowed else [])
        return [_error(UNAUTHORIZED) if i in refused else next(answers) for i in range(len(requests))]

    def finalize(self) -> None:
        self.role.finalize()


class _Role:
    def execute(self, requests: list[Request]) -> list[Response] | None:
        return [self.respond(request) for request in requests]

    def respond(self, request: Request) -> Response:
        try:
            return self.convert(_getter(request))
        except InvalidRequestError as exc:
            return _error(str(exc))

    def convert(self, get: Getter) -> Response:
        raise InvalidRequestError(f"{type(self).__name__} answers through its own execute")

    def finalize(self) -> None:
        pass


class Preprocessing(_Role):
    def __init__(self, node: NodeConfig) -> None:
        self.tokenizer = Tokenizer(node.engine.engine_dir)

    def convert(self, get: Getter) -> Response:
        prompt, chat = codecs.parse_text(get)
        return _response(codecs.encode_ids(self.tokenizer.encode(prompt, chat=chat)))


class Prefill(_Role):
    """``handshake``: decode endpoints in, our endpoint out; ``prefill_request``: queue it, return the load."""

    def __init__(self, node: NodeConfig) -> None:
        self.transfers = _TransferMetrics()
        self.node_metrics = _NodeMetrics(Model.PREFILL)
        self.loop = prefill_loop(node, on_done=self.transfers.done, on_report=self.node_metrics.report)
        self.loop.on_fatal = _exit_process

    def convert(self, get: Getter) -> Response:
        try:
            call = codecs.parse_prefill_call(get)
            if isinstance(call, list):  # a handshake: decode endpoints in, ours out
                return _response(codecs.encode_endpoint(self.loop.handshake(call)))
            return _response(codecs.encode_load(self.loop.submit(call)))
        except (ValueError, ValidationError) as exc:  # nothing was started: the decoder need not fence
            return _error(refusal(str(exc)))

    def finalize(self) -> None:
        self.loop.stop()


class Decode(_Role):
    """Decoupled: responses go back through each request's sender, from the engine loop thread."""

    def __init__(self, node: NodeConfig) -> None:
        self.node = node
        self.metrics = _Metrics()
        self.events: KVEventLog | None = None  # the prefix cache's events for routers (``kv_events_query``)
        self.loop, self.tracer = decode_loop(node, on_report=self._report)
        desc = self.loop.engine.describe()
        self.events = KVEventLog(desc.cache_identity, desc.page_size)
        self.loop.on_fatal = _exit_process
        self._ids = RequestIds(group_name(node.role, node.group))
        self._live: dict[str, set[str]] = {}  # client request id -> its live requests (for `stop`)
        self._responders: dict[str, _Responder] = {}  # live request -> its responder (the watch thread's)
        self._live_lock = threading.Lock()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="decode-watch", daemon=True)
        self._watcher.start()

    def execute(self, requests: list[Request]) -> None:
        for request in requests:
            self.submit(request)

    def submit(self, request: Request) -> None:
        sender = request.get_response_sender()
        get = _getter(request)
        try:
            if codecs.is_stop(get):
                self.stop(request.request_id(), sender)
                return
            query = codecs.events_query(get)
            if query is not None:
                assert self.events is not None
                batch = self.events.since(query, self.loop.stalled_s(), self.loop.longest_step_s())  # + liveness
                sender.send(_response(codecs.encode_events(batch)), flags=FINAL)
                return
            call = codecs.parse_decode(get, self.node.limits.max_tokens)
        except InvalidRequestError as exc:  # answered on this request's stream; the others go on
            sender.send(_error(str(exc)), flags=FINAL)
            return
        ids, params = call.ids, call.params
        echo = tuple(ids) if call.echo else ()
        client = request.request_id()
        rid = self._ids.next(client)  # unique on this node and across the nodes it travels to
        if self.tracer is not None:
            self.tracer.mark(rid, "arrived", prompt_tokens=len(ids))
        responder = _Responder(sender, call.stream, self.loop, self.metrics, params.stop, self.tracer, echo)
        responder.outputs = frozenset(request.requested_output_names())
        with self._live_lock:
            self._responders[rid] = responder
            if client:
                self._live.setdefault(client, set()).add(rid)
        responder.on_done = lambda: self._forget(client, rid)
        self.loop.submit(rid, ids, params, responder)

    def _report(self, r: LoopReport) -> None:
        self.metrics.report(r)
        if self.events is not None and r.cache_events is not None:
            self.events.record(r.cache_events)

    def stop(self, client: str, sender: Any) -> None:
        """``stop``: abort every live request this request id names (TensorRT-LLM's stop request)."""
        if not client:
            sender.send(_error("input stop needs the request id of the requests to stop"), flags=FINAL)
            return
        with self._live_lock:
            rids = sorted(self._live.get(client, ()))
        for rid in rids:
            self.loop.cancel(rid)
        sender.send(flags=FINAL)

    def _forget(self, client: str, rid: str) -> None:
        with self._live_lock:
            self._responders.pop(rid, None)
            live = self._live.get(client)
            if live is not None:
                live.discard(rid)
                if not live:
                    del self._live[client]

    def _watch(self) -> None:
        """Every 100 ms, off the engine thread (asking a sender and recording a metric are each a round
        trip to the server process, which shares the node's core with the engine): cancelled live
        requests are marked and aborted — before their first token too, their KV still on the way —
        and the latency / token metrics gathered since are sent. A sender is asked only under the lock
        that ``_forget`` takes before its final response is sent: asking a response factory that
        Triton already released crashes the server."""
        while not self._closing.wait(0.1):
            try:
                self.metrics.flush()
            except Exception:  # Triton's own error types: the metrics lose this batch, cancellations go on
                log.exception("sending the node's metrics failed")
            with self._live_lock:
                rids = list(self._responders)
            for rid in rids:
                with self._live_lock:
                    responder = self._responders.get(rid)
                    cancelled = responder is not None and responder.sender.is_cancelled()
                    if cancelled:
                        assert responder is not None
                        responder.cancelled = True
                        del self._responders[rid]
                if cancelled:
                    self.loop.cancel(rid)

    def finalize(self) -> None:
        self._closing.set()
        self._watcher.join(1.0)
        self.loop.stop()
        self.metrics.flush()


class BatchAdapter(_Role):
    """``ensemble``: strip the batch dimension, stream the request through ``llm`` (BLS), put it back.
    One thread per request (BLS blocks), at most as many as the node can hold: the rest are shed."""

    def __init__(self, node: NodeConfig) -> None:
        self.node = node
        self.key = node.auth_key  # passed on to llm and decode (BLS)
        self._ids = itertools.count()
        self._room = threading.BoundedSemaphore(node.limits.max_pending + node.engine.scheduler.max_num_seqs)

    def execute(self, requests: list[Request]) -> None:
        for request in requests:
            if not self._room.acquire(blocking=False):
                held = self.node.limits.max_pending + self.node.engine.scheduler.max_num_seqs
                shed = f"{OVERLOADED}{held} ensemble requests are in flight here (max_pending + max_num_seqs)"
                request.get_response_sender().send(_error(shed), flags=FINAL)
                continue
            threading.Thread(target=self._serve, args=(request,), daemon=True, name="ensemble-request").start()

    def _serve(self, request: Request) -> None:
        try:
            self.serve(request)
        finally:
            self._room.release()

    def serve(self, request: Request) -> None:
        sender = request.get_response_sender()
        try:
            inputs = [
                pb_utils.Tensor(t.name(), unbatch(t.name(), t.as_numpy()))
                for t in request.inputs()
                if t.name() not in IGNORED
            ]
        except InvalidRequestError as exc:
            sender.send(_error(str(exc)), flags=FINAL)
            return
        inner_id = f"{request.request_id() or 'ensemble'}~{next(self._ids)}"  # unique: `stop` names only this one
        inner = pb_utils.InferenceRequest(
            model_name=Model.LLM.value,
            inputs=inputs,
            requested_output_names=[Tensor.TEXT_OUTPUT, Tensor.OUTPUT_LOG_PROBS],
            request_id=inner_id,
            parameters=key_parameters(self.key),
        )
        cumulative, failed, stopped = 0.0, False, False
        for response in inner.exec(decoupled=True):  # ends after llm's final response
            if not stopped and sender.is_cancelled():
                stopped = True  # this Triton cannot cancel a BLS request: stop it on the decode model
                _stop(inner_id, self.key)
            if failed or stopped:
                continue
            if response.has_error():
                failed = True
                sender.send(_error(response.error().message()), flags=FINAL)
                continue
            text = pb_utils.get_output_tensor_by_name(response, Tensor.TEXT_OUTPUT)
            if text is None:  # the empty final response
                continue
            logprobs = pb_utils.get_output_tensor_by_name(response, Tensor.OUTPUT_LOG_PROBS).as_numpy()
            cumulative += float(logprobs.sum())
            per_token, total = log_prob_outputs(logprobs, cumulative)
            sender.send(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor(Tensor.TEXT_OUTPUT, text_output(text.as_numpy())),
                        pb_utils.Tensor(Tensor.OUTPUT_LOG_PROBS, per_token),
                        pb_utils.Tensor(Tensor.CUM_LOG_PROBS, total),
                    ]
                )
            )
        if not failed:
            sender.send(flags=FINAL)


def _stop(request_id: str, key: str | None) -> None:
    """TensorRT-LLM's stop request to this node's ``decode`` model: it aborts the requests ``request_id`` names."""
    stop = pb_utils.InferenceRequest(
        model_name=Model.DECODE.value,
        inputs=_tensors(codecs.encode_stop()),
        requested_output_names=[],
        request_id=request_id,
        parameters=key_parameters(key),
    )
    for _ in stop.exec(decoupled=True):
        pass


def _getter(request: Request) -> Getter:
    def get(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get


def _tensors(arrays: Arrays) -> list[Any]:
    return [pb_utils.Tensor(name.value, value) for name, value in arrays.items()]


def _response(arrays: Arrays) -> Response:
    return pb_utils.InferenceResponse(output_tensors=_tensors(arrays))


def _exit_process(exc: BaseException) -> None:
    """The engine loop died (its requests were failed): end this process so that the launcher's
    supervision names the rank, instead of a server that looks alive and can no longer serve."""
    log.critical("the engine loop died (%s): exiting", exc)
    logging.shutdown()
    os._exit(70)


class _Gauge:
    """A Triton gauge that is sent a value only when it changed: every ``set`` is a round trip from this
    stub to the server process, which shares the node's core with the engine (ten a step cost ~1 ms)."""

    __slots__ = ("metric", "value")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.value: float | None = None

    def set(self, value: float) -> None:
        if value != self.value:
            self.metric.set(value)
            self.value = value


class _NodeMetrics:
    """Pages, queues and per-request records of a node's loop (both roles), from its ``LoopReport``s."""

    def __init__(self, model: Model) -> None:
        fam = pb_utils.MetricFamily
        self._families = [
            fam("disagg_kv_pages", "KV cache pages by state", fam.GAUGE),
            fam("disagg_queue_depth", "Requests waiting / running in the engine", fam.GAUGE),
            fam("disagg_live_records", "Per-request records held, by structure (0 on an idle node)", fam.GAUGE),
        ]
        pages, queue, records = self._families
        self._labels = {"model": model.value}
        states = ("free", "used", "pinned", "cached")  # cached: of the free ones, keeping a prefix until needed
        self.pages = {s: _Gauge(pages.Metric(labels=self._labels | {"state": s})) for s in states}
        self.queue = {q: _Gauge(queue.Metric(labels=self._labels | {"queue": q})) for q in ("waiting", "running")}
        self._records_family = records
        self.records: dict[str, _Gauge] = {}
        self._drafts_family = fam(
            "disagg_draft_tokens_total", "Speculative draft tokens, proposed / accepted", fam.COUNTER
        )
        self.drafts = {
            o: self._drafts_family.Metric(labels=self._labels | {"outcome": o}) for o in ("proposed", "accepted")
        }
        self._drafts_seen = (0, 0)
        self._prefills_family = fam(
            "disagg_prefills_total", "Prompts a disaggregated decode node prefilled itself / sent away", fam.COUNTER
        )
        where = ("local", "remote")
        self.prefills = {w: self._prefills_family.Metric(labels=self._labels | {"where": w}) for w in where}
        self._prefills_seen = (0, 0)
        self._cache_family = fam(
            "disagg_prefix_cache_tokens_total",
            "Prompt tokens looked up in this node's prefix cache / found there (hit rate: found / queried)",
            fam.COUNTER,
        )
        self.cache = {k: self._cache_family.Metric(labels=self._labels | {"kind": k}) for k in ("queried", "found")}
        self._cache_seen = (0, 0)

    def report(self, r: LoopReport) -> None:
        self.pages["free"].set(r.pages.free)
        self.pages["used"].set(r.pages.used)
        self.pages["pinned"].set(r.pages.pinned)
        self.pages["cached"].set(r.pages.cached)
        seen = (r.cache.queries, r.cache.hits)
        if seen != self._cache_seen:
            for kind, now, before in zip(("queried", "found"), seen, self._cache_seen, strict=True):
                self.cache[kind].increment(now - before)
            self._cache_seen = seen
        self.queue["waiting"].set(r.waiting)
        self.queue["running"].set(r.running)
        (proposed, accepted), (p0, a0) = r.drafts, self._drafts_seen
        if proposed > p0 or accepted > a0:
            self.drafts["proposed"].increment(proposed - p0)
            self.drafts["accepted"].increment(accepted - a0)
            self._drafts_seen = r.drafts
        if r.prefills != self._prefills_seen:
            for where, now, before in zip(("local", "remote"), r.prefills, self._prefills_seen, strict=True):
                if now > before:
                    self.prefills[where].increment(now - before)
            self._prefills_seen = r.prefills
        for what, n in r.records.items():
            if what not in self.records:
                self.records[what] = _Gauge(self._records_family.Metric(labels=self._labels | {"what": what}))
            self.records[what].set(n)


class _Metrics(_NodeMetrics):
    """Prometheus metrics next to Triton's own (served on its metrics port). The per-token ones are
    gathered here by the engine thread (``tokens``, ``finished``) and sent by ``flush`` from another:
    each ``observe`` / ``increment`` is a round trip to the server process (at batch 8, 16 a step took
    ~1 ms of a ~13 ms step), so they lag by at most the flush interval."""

    def __init__(self) -> None:
        super().__init__(Model.LLM)
        self._lock = threading.Lock()
        self._ttfts: list[float] = []
        self._gaps: list[float] = []
        self._acceptances: list[float] = []
        self._generated = 0
        self._prompted = 0
        fam = pb_utils.MetricFamily
        buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        self._latency = [
            fam("disagg_time_to_first_token_seconds", "Time from request arrival to its first token", fam.HISTOGRAM),
            fam("disagg_inter_token_latency_seconds", "Time between consecutive tokens of a request", fam.HISTOGRAM),
            fam("disagg_prompt_tokens_total", "Prompt tokens of finished requests", fam.COUNTER),
            fam("disagg_generation_tokens_total", "Generated tokens", fam.COUNTER),
            fam(
                "disagg_draft_acceptance_ratio", "Accepted / proposed draft tokens of finished requests", fam.HISTOGRAM
            ),
        ]
        ttft, itl, prompt, gen, acceptance = self._latency
        model = {"model": Model.LLM.value}
        self.ttft = ttft.Metric(labels=model, buckets=buckets)
        self.itl = itl.Metric(labels=model, buckets=buckets)
        self.prompt_tokens = prompt.Metric(labels=model)
        self.generation_tokens = gen.Metric(labels=model)
        self.acceptance = acceptance.Metric(labels=model, buckets=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])

    def tokens(self, n: int, wait_s: float, first: bool) -> None:
        """``n`` tokens after ``wait_s``: the first's wait is the TTFT, a burst's tokens share the wait."""
        with self._lock:
            if first:
                self._ttfts.append(wait_s)
                self._gaps += [0.0] * (n - 1)
            else:
                self._gaps += [wait_s / n] * n
            self._generated += n

    def finished(self, prompt_tokens: int, drafts: tuple[int, int]) -> None:
        with self._lock:
            self._prompted += prompt_tokens
            if drafts[0]:
                self._acceptances.append(drafts[1] / drafts[0])

    def flush(self) -> None:
        with self._lock:
            ttfts, gaps, acceptances = self._ttfts, self._gaps, self._acceptances
            generated, prompted = self._generated, self._prompted
            self._ttfts, self._gaps, self._acceptances, self._generated, self._prompted = [], [], [], 0, 0
        for metric, values in ((self.ttft, ttfts), (self.itl, gaps), (self.acceptance, acceptances)):
            for v in values:
                metric.observe(v)
        if generated:
            self.generation_tokens.increment(generated)
        if prompted:
            self.prompt_tokens.increment(prompted)


class _TransferMetrics:
    """Prefill nodes: KV bytes sent and the time from a prefill request to its last completed write."""

    def __init__(self) -> None:
        fam = pb_utils.MetricFamily
        buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
        self._families = [
            fam("disagg_kv_transfer_bytes_total", "KV bytes written to decode nodes", fam.COUNTER),
            fam("disagg_kv_transfer_seconds", "Prefill request received -> its last KV write completed", fam.HISTOGRAM),
        ]
        model = {"model": Model.PREFILL.value}
        self.bytes = self._families[0].Metric(labels=model)
        self.seconds = self._families[1].Metric(labels=model, buckets=buckets)

    def done(self, outcome: PrefillOutcome, seconds: float) -> None:
        self.bytes.increment(outcome.bytes_posted)
        self.seconds.observe(seconds)


class _Responder:
    """Streams token windows (``stream`` true) or sends all tokens once; aborts on cancellation."""

    def __init__(
        self,
        sender: Any,
        stream: bool,
        loop: DecodeLoop,
        metrics: _Metrics,
        stop: tuple[str, ...],
        tracer: Tracer | None,
        echo: tuple[int, ...] = (),
    ) -> None:
        self.sender = sender
        self.outputs: frozenset[str] = frozenset()  # the outputs the caller asked for (an ensemble: its map's)
        self.cancelled = False  # the client went away (set by the node's watch thread)
        self.echo = echo  # prompt ids the (unstreamed) output starts with
        self.on_done: Callable[[], None] | None = None  # once the request has ended, however it ended
        self.tracer = tracer
        self.stop = stop
        self.stream = stream
        self.loop = loop
        self.metrics = metrics
        self.all_ids: list[int] = []
        self.generated = 0
        self.logprobs: list[TokenLogprobs] = []  # of the tokens generated since the last response
        self.last = time.monotonic()
        self.first = True
        self.prompt: codecs.Scores = None  # the prompt's log-probabilities, until the next response carries them

    def __call__(self, out: RequestOutput) -> None:
        if out.finished and self.on_done is not None:
            self.on_done()
        if self.cancelled:  # the client went away: stop, and only close the stream
            if out.finished:
                self._close_trace(out.request_id, "cancelled")
                self.sender.send(flags=FINAL)  # Triton releases the request only once it is closed
            else:
                self.loop.cancel(out.request_id)
            return
        if out.error is not None:
            self._close_trace(out.request_id, "failed", error=out.error[:200])
            self.sender.send(_error(out.error), flags=FINAL)
            return
        if out.finish_reason is FinishReason.ABORT:  # aborted here: close the stream
            self._close_trace(out.request_id, "aborted")
            self.sender.send(flags=FINAL)
            return
        self._observe(out)
        self.generated += len(out.new_token_ids)
        self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs:
            self.prompt = codecs.prompt_scores(out.prompt_logprobs)
        if self.stream:
            if out.text or out.finished:
                self._send(out.text_window, out.text_skip, out)
        else:
            self.all_ids.extend(out.new_token_ids)
            if out.finished:
                self._send((*self.echo, *self.all_ids), 0, out)

    def _close_trace(self, request_id: str, event: str, **fields: object) -> None:
        """A request that ends without its last token still gets its trace line (no record left open)."""
        if self.tracer is not None:
            self.tracer.close(request_id, event, **fields)

    def _send(self, window: tuple[int, ...], skip: int, out: RequestOutput) -> None:
        reason = "" if not out.finished else "length" if out.finish_reason is FinishReason.LENGTH else "stop"
        lps, self.logprobs = self.logprobs, []
        prompt, self.prompt = self.prompt, None
        piece = DecodePiece(
            window, skip, self.generated, reason, tuple(lp.logprob for lp in lps),
            tuple(lp.top_ids for lp in lps), tuple(lp.top_logprobs for lp in lps), out.cached_tokens, prompt,
            self._text(window, skip, out),
        )  # fmt: skip
        arrays = codecs.encode_piece(piece, self.outputs)
        self.sender.send(_response(arrays), flags=FINAL if out.finished else 0)

    def _text(self, window: tuple[int, ...], skip: int, out: RequestOutput) -> str:
        """``text_output``: the window's new text (``window_text``, the engine loop's own rule: a streamed
        piece's is the loop's ``out.text``), cut at a stop string; a request answered at once decodes its
        whole window (``whole_text``: a character it stopped inside of is dropped, not all of its text).
        Only when asked for: clients of ``decode`` (the router) decode windows themselves."""
        tok = self.loop.engine.tokenizer
        if Tensor.TEXT_OUTPUT not in self.outputs or tok is None:
            return ""
        if self.stream and not (out.finished and self.stop):
            return out.text
        text = window_text(tok, list(window), skip) if self.stream else whole_text(tok, list(window))
        for stop in self.stop:  # a stop string inside this piece ends the text there
            text = text.split(stop, 1)[0]
        return text

    def _observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if self.tracer is not None:
            if self.first and out.new_token_ids:
                self.tracer.mark(out.request_id, "first_token")
            if out.finished:
                proposed, accepted = out.drafts
                tokens = len(out.output_ids) or len(self.all_ids)
                self.tracer.finish(
                    out.request_id, output_tokens=tokens, drafts_proposed=proposed, drafts_accepted=accepted,
                    cached_tokens=out.cached_tokens,
                )  # fmt: skip
        n = len(out.new_token_ids)
        if n:  # per token: the tokens of a speculative burst share the wait before it
            dt = now - self.last
            self.metrics.tokens(n, dt, self.first)
            self.first, self.last = False, now
        if out.finished:
            self.metrics.finished(out.prompt_tokens, out.drafts)


def _error(message: str) -> Response:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
