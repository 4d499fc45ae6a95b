"""Prometheus metrics: what the gateway counts on the call path, and what ``/metrics`` reads at scrape time.

- Call path: ``Metrics.observe_call(record)`` once per call that got a span (``Gateway.observe``), plus the
  in-flight gauge around the call. Labelled children are cached per label tuple, so a call costs dict look-ups
  and a few ``inc``/``observe`` — no label dict building.
- Labels are bounded: ``alias`` and ``backend`` only ever come from the model registry (a call for an unknown
  alias is refused before it is counted; refusals are counted by route and status only), ``route`` is one of
  the four data-plane operations, ``status`` an HTTP status (499: the client went away). Never rollout ids.
- Scrape time: ``refresh`` reads rollouts/attempts by status, the queue depth and the model list from the
  store (reader thread or asyncpg, never the loop), bounded by a timeout; when the store is slow or down the
  last snapshot is served and ``rollway_store_up`` says 0. Backend health comes from the router. Those gauges
  are ``gateway.scrape``'s.
- Several worker processes: with ``PROMETHEUS_MULTIPROC_DIR`` set (before the process starts), counters and
  histograms are kept in that directory by prometheus_client and every scrape merges all processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from rollway.gateway.capture import OPERATIONS
from rollway.gateway.record import CallRecord
from rollway.gateway.routing import Router
from rollway.gateway.scrape import Snapshot, StateCollector
from rollway.store import Store

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROUTES = {operation: f"/v1/{path}" for path, operation in OPERATIONS.items()}
CANCELLED_STATUS = 499
SCRAPE_STORE_TIMEOUT = 2.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Why a client connection was refused before its request reached the application (``rollway.app.connections``).
CONNECTION_REFUSALS = ("cap", "header_too_large", "header_timeout")


@dataclass(slots=True)
class _CallSeries:
    requests: Any
    duration: Any


@dataclass(slots=True)
class _ModelSeries:
    ttft: Any
    input_tokens: Any
    output_tokens: Any
    retries: Any
    failovers: Any
    untrainable: Any
    without_logprobs: Any
    scored_logprobs: Any


class Metrics:
    """Every Rollway metric, in its own registry (no process-global state; one per application)."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir if multiprocess_dir is not None else _multiproc_dir()
        self.store_timeout = SCRAPE_STORE_TIMEOUT
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        call = ["alias", "backend", "route", "status"]
        model = ["alias", "backend", "route"]
        self.requests = Counter("rollway_requests", "LLM calls answered, by outcome status.", call, registry=r)
        self.duration = Histogram(
            "rollway_request_duration_seconds",
            "Time from arrival to the end of the answer.",
            call,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "rollway_time_to_first_token_seconds",
            "Streamed calls: time from arrival to the first token.",
            model,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter("rollway_input_tokens", "Prompt tokens reported by backends.", model, registry=r)
        self.output_tokens = Counter(
            "rollway_output_tokens", "Completion tokens reported by backends.", model, registry=r
        )
        self.retries = Counter("rollway_upstream_retries", "Retries of calls to backends.", model, registry=r)
        self.failovers = Counter(
            "rollway_upstream_failovers", "Retries that moved to another backend.", model, registry=r
        )
        self.untrainable = Counter(
            "rollway_untrainable_calls",
            "Completions whose answer had no token ids (not trainable): an openai-kind backend, or an engine that "
            "did not return them.",
            model,
            registry=r,
        )
        self.without_logprobs = Counter(
            "rollway_calls_without_logprobs",
            "Trainable completions (token ids recorded) whose logprobs are missing or do not cover every output "
            "token: PPO/GRPO importance ratios need them all.",
            model,
            registry=r,
        )
        self.scored_logprobs = Counter(
            "rollway_calls_scored_logprobs",
            "Trainable completions whose engine gave token ids without every logprob, and whose logprobs Rollway "
            "then had the same engine score (prompt logprobs of prompt and answer): rollway.logprobs_source=scored.",
            model,
            registry=r,
        )
        self.errors = Counter(
            "rollway_request_errors",
            "Calls that ended in an error (also mid-stream ones, whose status is 200), by error type.",
            ["alias", "route", "error_type"],
            registry=r,
        )
        self.exported_groups = Counter(
            "rollway_groups_exported",
            "Complete groups the exports (triplets, SLIME, verl) handed out, by health: without_calls (a member made "
            "no LLM call: a client-side cache, dspy's by default), identical_answers (every member gave the same "
            "token ids: no advantage to learn from), ok. A group pulled twice counts twice.",
            ["health"],
            registry=r,
        )
        self.shed = Counter(
            "rollway_calls_shed",
            "Calls refused at once (503, Retry-After) because the process was running its ROLLWAY_MAX_CALLS_IN_FLIGHT: "
            "nothing recorded; the OpenAI SDKs retry them.",
            registry=r,
        )
        self.rejected = Counter(
            "rollway_requests_rejected",
            "Calls refused before reaching a model (bad input, unknown model, authentication): no span.",
            ["route", "status"],
            registry=r,
        )
        self.connections_refused = Counter(
            "rollway_connections_refused",
            "Client connections answered and closed before their request reached the application, by reason: cap "
            "(503, ROLLWAY_MAX_CONNECTIONS), header_too_large (431, ROLLWAY_MAX_HEADER_BYTES), header_timeout (408, "
            "ROLLWAY_HEADER_TIMEOUT).",
            ["reason"],
            registry=r,
        )
        self._connections_refused = {reason: self.connections_refused.labels(reason) for reason in CONNECTION_REFUSALS}
        self.in_flight = Gauge(
            "rollway_requests_in_flight",
            "Calls admitted to a model and not yet finished.",
            ["alias"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.spans = Counter("rollway_spans_ingested", "Spans written to the store, by source.", ["source"], registry=r)
        self.spans_unwritten = Counter(
            "rollway_spans_unwritten",
            "Calls whose span the store failed to write (a successful completion is then not handed over).",
            registry=r,
        )
        self.write_seconds = Histogram(
            "rollway_store_write_seconds",
            "Duration of one store write transaction (SQLite: one group commit).",
            buckets=WRITE_BUCKETS,
            registry=r,
        )
        self.write_batch = Histogram(
            "rollway_store_write_batch_size",
            "Operations committed together in one store write transaction.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.export_spans = Counter(
            "rollway_otlp_export_spans",
            "Spans offered to the OTLP exporter, by outcome (exported, dropped: queue full, failed: send failed).",
            ["outcome"],
            registry=r,
        )
        self.catalog_changes = Counter(
            "rollway_catalog_changes",
            "New catalog revisions (model alias or key changes, here or through another replica) this process took"
            " in, each dropping its cached aliases and keys; the first one it sees after starting included.",
            registry=r,
        )
        self.weight_updates = Counter(
            "rollway_weight_updates",
            "Weight updates that ended, by how (committed, failed, aborted, expired).",
            ["alias", "state"],
            registry=r,
        )
        self.weight_update_held = Histogram(
            "rollway_weight_update_held_seconds",
            "How long a weight update held its alias's new calls (from its begin to its end).",
            ["alias"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.weight_update_aborted = Counter(
            "rollway_weight_update_aborted_calls",
            "Calls in flight that weight updates ended (recorded as aborted spans).",
            ["alias"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "rollway_metrics_store_errors", "Scrapes that could not read the store in time.", registry=r
        )
        self._calls: dict[tuple[str | None, str, str, int], _CallSeries] = {}
        self._models: dict[tuple[str | None, str, str], _ModelSeries] = {}
        self._in_flight: dict[str, Any] = {}
        self._rejected: dict[tuple[str, int], Any] = {}
        self._gateway_spans = self.spans.labels("gateway")
        self._api_spans = self.spans.labels("api")
        self.exported = self.export_spans.labels("exported")
        self.dropped = self.export_spans.labels("dropped")
        self.export_failed = self.export_spans.labels("failed")
        self._state = StateCollector()
        self.registry.register(self._state)

    # -- call path ------------------------------------------------------------------------------------

    def count_in_flight(self, alias: str) -> Any:
        """The in-flight gauge child of ``alias``, incremented; the caller decrements it when the call ends."""
        child = self._in_flight.get(alias)
        if child is None:
            child = self._in_flight[alias] = self.in_flight.labels(alias)
        child.inc()
        return child

    def observe_call(self, record: CallRecord, span_written: bool) -> None:
        """Count one finished call (its span is written or failed to be): the one place per call."""
        backend = record.backend.backend_id if record.backend is not None else ""
        status = CANCELLED_STATUS if record.cancelled else (record.status_code or 0)
        key = (record.alias, backend, record.operation, status)
        series = self._calls.get(key)
        if series is None:
            series = self._call_series(key)
        series.requests.inc()
        if record.end_time is not None:
            series.duration.observe(record.end_time - record.start_time)
        if span_written:
            self._gateway_spans.inc()
        else:
            self.spans_unwritten.inc()
        if record.error_type is not None:
            self.errors.labels(record.alias or "", ROUTES.get(record.operation, ""), record.error_type).inc()
        response = record.response
        usage = response.get("usage") if response is not None else None
        # Only an answer passed on as a stream has a first token: a streamed request answered with one body (an
        # error, an embedding) has none, though its span tells when that body came.
        streamed = record.accumulator is not None and record.ttft_seconds is not None
        untrainable = record.completed and not record.trainable
        incomplete = record.trainable and not record.logprobs_complete
        scored = record.scored_logprobs is not None
        if not (usage or record.retry_count or streamed or untrainable or incomplete or scored):
            return
        model_key = (record.alias, backend, record.operation)
        model = self._models.get(model_key)
        if model is None:
            model = self._model_series(model_key)
        if streamed:
            model.ttft.observe(record.ttft_seconds)
        if usage:
            tokens_in = usage.get("prompt_tokens", usage.get("input_tokens"))
            tokens_out = usage.get("completion_tokens", usage.get("output_tokens"))
            if isinstance(tokens_in, int) and tokens_in > 0:
                model.input_tokens.inc(tokens_in)
            if isinstance(tokens_out, int) and tokens_out > 0:
                model.output_tokens.inc(tokens_out)
        if untrainable:
            model.untrainable.inc()
        if incomplete:
            model.without_logprobs.inc()
        if scored:
            model.scored_logprobs.inc()
        if record.retry_count:
            model.retries.inc(record.retry_count)
            if record.failovers:
                model.failovers.inc(record.failovers)

    def count_exported_group(self, verdict: str) -> None:
        """A complete group an export handed out (``admin.groups``)."""
        self.exported_groups.labels(verdict).inc()

    def observe_rejected(self, op_path: str, status: int) -> None:
        """A data-plane call refused before it reached a model (no alias label: the name may be anything)."""
        key = (op_path, status)
        child = self._rejected.get(key)
        if child is None:
            route = f"/v1/{op_path}" if op_path in OPERATIONS or op_path == "models" else "other"
            child = self._rejected[key] = self.rejected.labels(route, str(status))
        child.inc()

    def count_refused_connection(self, reason: str) -> None:
        """A client connection refused before its request reached the application (one of ``CONNECTION_REFUSALS``)."""
        self._connections_refused[reason].inc()

    def _call_series(self, key: tuple[str | None, str, str, int]) -> _CallSeries:
        alias, backend, operation, status = key
        labels = (alias or "", backend, ROUTES.get(operation, operation), str(status))
        series = self._calls[key] = _CallSeries(self.requests.labels(*labels), self.duration.labels(*labels))
        return series

    def _model_series(self, key: tuple[str | None, str, str]) -> _ModelSeries:
        alias, backend, operation = key
        labels = (alias or "", backend, ROUTES.get(operation, operation))
        series = self._models[key] = _ModelSeries(
            ttft=self.ttft.labels(*labels),
            input_tokens=self.input_tokens.labels(*labels),
            output_tokens=self.output_tokens.labels(*labels),
            retries=self.retries.labels(*labels),
            failovers=self.failovers.labels(*labels),
            untrainable=self.untrainable.labels(*labels),
            without_logprobs=self.without_logprobs.labels(*labels),
            scored_logprobs=self.scored_logprobs.labels(*labels),
        )
        return series

    # -- store hooks ----------------------------------------------------------------------------------

    def observe_update(self, alias: str, state: str, held_seconds: float | None, aborted: int) -> None:
        """A weight update this process ended."""
        self.weight_updates.labels(alias, state).inc()
        if held_seconds is not None:
            self.weight_update_held.labels(alias).observe(held_seconds)
        if aborted:
            self.weight_update_aborted.labels(alias).inc(aborted)

    def observe_write(self, size: int, seconds: float) -> None:
        self.write_batch.observe(size)
        self.write_seconds.observe(seconds)

    def observe_spans_added(self, count: int) -> None:
        if count:
            self._api_spans.inc(count)

    @property
    def engine_versions(self) -> Callable[[], Iterable[tuple[str, str, bool]]] | None:
        return self._state.engine_versions

    @engine_versions.setter
    def engine_versions(self, source: Callable[[], Iterable[tuple[str, str, bool]]] | None) -> None:
        self._state.engine_versions = source

    def attach(self, store: Store, router: Router) -> None:
        store.writer.stats.observer = self.observe_write
        store.span_observer = self.observe_spans_added
        self._state.router = router

    # -- scrape -----------------------------------------------------------------------------------------

    async def refresh(self, store: Store) -> None:
        """Read the store-derived gauges for this scrape; on timeout or error keep the last snapshot."""
        try:
            async with asyncio.timeout(self.store_timeout):
                (rollouts, attempts), models = await asyncio.gather(store.status_counts(), store.list_models())
        except Exception:
            self.scrape_errors.inc()
            self._state.store_up = False
            return
        self._state.store_up = True
        self._state.snapshot = Snapshot(rollouts, attempts, models, time.time())

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric (of every process, in multiprocess mode)."""
        if not self.multiprocess_dir:
            return generate_latest(self.registry)
        merged = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(merged, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        merged.register(self._state)
        return generate_latest(merged)

    def close(self) -> None:
        """Multiprocess mode: this process's live gauges stop counting."""
        if self.multiprocess_dir:
            from prometheus_client import multiprocess

            with contextlib.suppress(OSError):
                multiprocess.mark_process_dead(os.getpid(), self.multiprocess_dir)  # type: ignore[no-untyped-call]


def _multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
