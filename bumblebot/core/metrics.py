"""Prometheus metrics: off by default, on with ``metrics.listen``.

One :class:`Metrics` per daemon owns its own ``CollectorRegistry``. It never uses
``prometheus_client``'s global one, so two daemons in one process (tests) never clash and
nothing another library registers shows up. The parts that count get it through their
constructors: ``LLM``, ``Delivery``, ``TurnRunner``, ``Engine`` and the ``Ledger``. Each one
defaults to :data:`NO_METRICS`, whose hooks do nothing.

Series (all prefixed ``bumblebot_``):

==================================  =========  ===================================================
``bumblebot_turns_total``           counter    turns finished, by ``status`` (``done``, ``failed``)
``bumblebot_model_requests_total``  counter    completions asked of the endpoint (``LLM.complete``:
                                               turn steps, the classifier, judges, summaries), by
                                               ``outcome``: ``ok``, ``error`` or ``timeout``
                                               (``ModelTimeout``). The client's own retries and
                                               the LLM's fallback re-sends count as part of the
                                               one request. A cancelled request (``/stop``, a
                                               shutdown, the classifier's own time limit) is not
                                               counted.
``bumblebot_model_request_seconds`` histogram  their latency, seconds, from the call to the answer
                                               or the error. It includes the wait for a slot
                                               under ``llm.max_concurrent_requests``.
``bumblebot_model_tokens_total``    counter    tokens answered requests used (completions and
                                               transcriptions), by ``type`` (``prompt``, ``cached``:
                                               the prompt tokens served from the endpoint's cache,
                                               ``completion``, ``reasoning``: the completion tokens
                                               spent reasoning), ``model`` and ``kind`` of request
                                               (``turn``, ``automation``, ``judge``…); an endpoint
                                               that reports none is counted at the estimate
``bumblebot_model_cost_total``      counter    what they cost at ``llm.prices``, by ``model``,
                                               ``kind`` and ``currency`` (``llm.currency``); a model
                                               without a price adds nothing
``bumblebot_audio_seconds_total``   counter    seconds of audio transcribed, by ``model``
``bumblebot_deliveries_total``      counter    delivery attempts of outbox rows, by ``outcome``:
                                               ``sent``; ``failed`` (refused for good, or it could
                                               not be split); ``queued`` (left pending for the
                                               sweeper). A row that stays pending counts
                                               ``queued`` once per attempt.
``bumblebot_queue_depth``           gauge      messages waiting in the inboxes of the loaded
                                               conversations (not yet taken by a turn), read
                                               at each scrape
==================================  =========  ===================================================

The exporter is ``prometheus_client``'s own HTTP server (``start_http_server``). It runs in
a daemon thread and answers ``GET /metrics`` (any path, in fact) in the text format. This
is the simplest robust choice: the library maintains it, and a scrape never waits on the
event loop, so it works even while the loop is stalled (the watchdog's case). It needs no
web framework in the daemon. :meth:`Metrics.serve` binds in a worker thread, because
``HTTPServer`` resolves its own name with ``getfqdn``, which can be slow, and it must not
block the event loop. Collectors are thread-safe. The queue-depth callback runs in the
exporter's thread and only reads list lengths.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from bumblebot.core.errors import ConfigError, ModelTimeout
from bumblebot.core.usage import Usage

log = logging.getLogger(__name__)

TURN_STATUSES: Final = ("done", "failed")
MODEL_OUTCOMES: Final = ("ok", "error", "timeout")
DELIVERY_OUTCOMES: Final = ("sent", "failed", "queued")
#: Latency buckets of model requests, seconds: a local reflex answer takes well under a second,
#: a deliberate step on a slow endpoint a minute or more.
MODEL_BUCKETS_S: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` split into its parts.

    Accepted forms: ``127.0.0.1:9464``, ``localhost:9464``, ``[::1]:9464``, and ``:9464``
    (every IPv4 interface). Port 0 takes a free port (tests).

    Raises:
        ValueError: not ``host:port`` with a port from 0 to 65535 (the message says so).
    """
    host, sep, port = listen.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, e.g. 127.0.0.1:9464 (got {listen!r})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"write an IPv6 address in brackets, e.g. [::1]:9464 (got {listen!r})")
    return host or "0.0.0.0", int(port)


class Metrics:
    """The daemon's counters, and the HTTP exporter that serves them.

    Lifecycle: counting works from construction on. :meth:`serve` starts the exporter
    once (a second call raises), and :meth:`stop` ends it (idempotent). Counting goes
    on after a stop; nobody reads it.
    """

    def __init__(self, worker: str | None = None) -> None:
        # a worker of a cluster names itself once, in OpenMetrics' target_info{worker="…"}
        self.registry = CollectorRegistry(auto_describe=True, target_info={"worker": worker} if worker else None)
        self.turns = Counter(
            "bumblebot_turns", "Turns finished, by status", ["status"], registry=self.registry
        )
        self.model_requests = Counter(
            "bumblebot_model_requests", "Chat completions asked of the model endpoint, by outcome",
            ["outcome"], registry=self.registry,
        )
        self.model_latency = Histogram(
            "bumblebot_model_request_seconds", "Latency of model requests, seconds",
            buckets=MODEL_BUCKETS_S, registry=self.registry,
        )
        self.model_tokens = Counter(
            "bumblebot_model_tokens", "Tokens model requests used, by type, model and kind of request",
            ["type", "model", "kind"], registry=self.registry,
        )
        self.model_cost = Counter(
            "bumblebot_model_cost", "What model requests cost at llm.prices, by model and kind of request",
            ["model", "kind", "currency"], registry=self.registry,
        )
        self.model_cuts = Counter(
            "bumblebot_model_cuts", "Model requests the client cut at their token budget, by how (tokens or "
            "deadline) and model", ["by", "model"], registry=self.registry,
        )
        self.audio_seconds = Counter(
            "bumblebot_audio_seconds", "Seconds of audio transcribed, by model", ["model"], registry=self.registry,
        )
        self.deliveries = Counter(
            "bumblebot_deliveries", "Delivery attempts of outbox messages, by outcome",
            ["outcome"], registry=self.registry,
        )
        self.queue_depth = Gauge(
            "bumblebot_queue_depth", "Messages waiting in the inboxes of loaded conversations",
            registry=self.registry,
        )
        for status in TURN_STATUSES:  # every series exists from the start, at 0
            self.turns.labels(status=status)
        for outcome in MODEL_OUTCOMES:
            self.model_requests.labels(outcome=outcome)
        for outcome in DELIVERY_OUTCOMES:
            self.deliveries.labels(outcome=outcome)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    # -- hooks (called by the parts that count) ----------------------------------------------

    def turn_finished(self, status: str) -> None:
        """A turn was closed with ``status`` (``done`` or ``failed``)."""
        self.turns.labels(status=status).inc()

    @contextlib.contextmanager
    def model_request(self) -> Iterator[None]:
        """Times the block as one model request and counts its outcome: ``timeout`` when it
        raises ``ModelTimeout``, ``error`` for any other exception, else ``ok``. A cancelled
        block is not counted."""
        started = time.monotonic()
        outcome: str | None = "ok"
        try:
            yield
        except asyncio.CancelledError:
            outcome = None  # /stop, a shutdown or a caller's own time limit: not the endpoint's doing
            raise
        except ModelTimeout:
            outcome = "timeout"
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            if outcome is not None:
                self.model_latency.observe(time.monotonic() - started)
                self.model_requests.labels(outcome=outcome).inc()

    def model_usage(self, kind: str, usage: Usage, cost: float | None, currency: str) -> None:
        """An answered request of ``kind`` used ``usage`` and cost ``cost`` (``None``: unpriced)."""
        for kind_of_token, count in (
            ("prompt", usage.prompt), ("cached", usage.cached),
            ("completion", usage.completion), ("reasoning", usage.reasoning),
        ):
            self.model_tokens.labels(type=kind_of_token, model=usage.model, kind=kind).inc(max(count, 0))
        if cost is not None:
            self.model_cost.labels(model=usage.model, kind=kind, currency=currency).inc(max(cost, 0.0))
        if usage.seconds > 0:
            self.audio_seconds.labels(model=usage.model).inc(usage.seconds)
        if usage.cut:
            self.model_cuts.labels(by=str(usage.cut.get("by")), model=usage.model).inc()

    def delivery(self, outcome: str) -> None:
        """A delivery attempt of an outbox row ended ``sent``, ``failed`` or ``queued``."""
        self.deliveries.labels(outcome=outcome).inc()

    def watch_queue(self, depth: Callable[[], int]) -> None:
        """Read ``bumblebot_queue_depth`` from ``depth()`` at every scrape.

        ``depth`` runs in the exporter's thread: it must only read, never await or lock.
        """
        self.queue_depth.set_function(lambda: float(depth()))

    # -- the exporter ----------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The current values in Prometheus' text format (what ``GET /metrics`` returns)."""
        return generate_latest(self.registry)

    @property
    def address(self) -> tuple[str, int] | None:
        """The host and port the exporter listens on (the real port when 0 was asked for);
        ``None`` before :meth:`serve`, and after :meth:`stop`."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    async def serve(self, listen: str) -> None:
        """Start the HTTP exporter on ``listen`` (``host:port``, see :func:`parse_listen`).
        It returns once the socket is bound, and scrapes are then answered from a daemon
        thread.

        Raises:
            ConfigError: ``listen`` is not ``host:port``, or the address cannot be bound
                (in use, not a local address, a privileged port). The key named is
                ``metrics.listen``.
            RuntimeError: the exporter was already started, or stopped.
        """
        if self._server is not None or self._stopped:
            raise RuntimeError("metrics exporter already started" if self._server else "metrics exporter was stopped")
        try:
            host, port = parse_listen(listen)
        except ValueError as exc:
            raise ConfigError("config", "metrics.listen", str(exc)) from None
        try:
            self._server, self._thread = await asyncio.to_thread(
                start_http_server, port, host, self.registry
            )
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ConfigError("config", "metrics.listen", f"an address this host can listen on ({reason}: {listen})") from exc
        self._thread.name = "bumblebot:metrics"
        log.info("metrics served at http://%s:%d/metrics", *self.address)  # type: ignore[str-format]

    async def stop(self) -> None:
        """Stop the exporter and close its socket (idempotent; nothing to do if it never
        started). Takes up to half a second: the server checks for shutdown that often."""
        self._stopped = True
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        await asyncio.to_thread(server.shutdown)
        server.server_close()
        if thread is not None:
            await asyncio.to_thread(thread.join, 5.0)


class NoMetrics(Metrics):
    """Metrics off: every hook does nothing, and nothing is registered or served."""

    def __init__(self) -> None:  # no registry, no collectors: nothing to count into
        self._server = None
        self._thread = None
        self._stopped = False

    def turn_finished(self, status: str) -> None:
        pass

    @contextlib.contextmanager
    def model_request(self) -> Iterator[None]:
        yield

    def model_usage(self, kind: str, usage: Usage, cost: float | None, currency: str) -> None:
        pass

    def delivery(self, outcome: str) -> None:
        pass

    def watch_queue(self, depth: Callable[[], int]) -> None:
        pass

    def exposition(self) -> bytes:
        return b""

    async def serve(self, listen: str) -> None:
        raise RuntimeError("metrics are off: construct Metrics() to serve them")

    async def stop(self) -> None:
        pass


#: The default of every constructor's ``metrics`` argument (stateless, so shared).
NO_METRICS: Final[Metrics] = NoMetrics()

