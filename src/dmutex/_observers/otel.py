"""dmutex's OpenTelemetry metrics and spans, recorded through the global providers.

Rules of this module:

1. ``opentelemetry-api`` is imported here only, and only when an instance
   asks for its default observers: dmutex has no runtime dependency, and
   without the package nothing changes.
2. The observer listens (``dmutex._core.observe``, rule 5) only once a
   meter or tracer provider other than the API's default (a proxy that
   records nothing until an SDK is set, or a no-op one) is configured. The
   providers are looked at once a second at most (:data:`LOOK_EVERY`:
   asking the API for them costs more than a lock's whole cycle in memory),
   so with the API alone an operation costs a clock reading, and a provider
   set later is found within a second. The API allows no provider to be
   replaced once set, so once found it is kept.
3. The instruments (:data:`INSTRUMENTS`) are made once, from the global
   meter provider, when the observer first listens. Every measurement
   carries ``dmutex.service``, ``dmutex.kind`` and ``dmutex.backend``; the
   key (``dmutex.key``) only with ``keys=True``, since keys may be
   unbounded in number. The durations are histograms, recorded as they
   happen; the counts are asynchronous (observable) counters, kept here
   under a lock and read by the SDK at each collection: an SDK's
   measurement costs microseconds (its attributes cleaned and hashed each
   time), a count here a dictionary update.
4. Spans: one per ``acquire_with_retry``, ``run`` and ``run_with_retry``
   (``dmutex.acquire_with_retry``, ``dmutex.run``, ``dmutex.run_with_retry``),
   started as the call starts, under the caller's current span, and ended
   with its outcome (``dmutex.outcome``) and, when granted, the fence
   (``dmutex.fence``), the attempts and the wait. A run's span is current
   while it runs, so the callback's own spans are its children (and its
   acquire's). A wake is a span event (``dmutex.woken``); so is a grant
   inside a run (``dmutex.acquired``). A lost lease is an event
   (``dmutex.lost``) and the span's status is ERROR, as it is for an error.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Iterable
from contextvars import Token
from typing import TYPE_CHECKING, Any, cast

from .._core.observe import (
    Acquired,
    Attempted,
    Ended,
    Event,
    Lost,
    NotAcquired,
    Observer,
    Operation,
    Released,
    Renewed,
    Source,
    Started,
    Woken,
)
from .._version import __version__

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import CallbackOptions, Histogram, MeterProvider, Observation
    from opentelemetry.trace import Span, TracerProvider

__all__ = ["INSTRUMENTS", "OpenTelemetryObserver", "default"]

INSTRUMENTS = {
    # name: (kind, unit, description)
    "dmutex.lock.wait.duration": (
        "histogram",
        "s",
        "Time from an acquire's call to its answer, by dmutex.outcome",
    ),
    "dmutex.lock.hold.duration": (
        "histogram",
        "s",
        "Time a lease was held, from its grant to its release or loss, by dmutex.outcome",
    ),
    "dmutex.lock.attempts": ("counter", "{attempt}", "Attempts of acquires answered"),
    "dmutex.lock.refusals": (
        "counter",
        "{attempt}",
        "Attempts refused: every permit of the key held",
    ),
    "dmutex.lock.renewals": ("counter", "{renewal}", "Automatic renewals that succeeded"),
    "dmutex.lock.renewal.failures": (
        "counter",
        "{renewal}",
        "Automatic renewals that failed (each is retried until the lease's deadline)",
    ),
    "dmutex.lock.lost": ("counter", "{lease}", "Leases found lost"),
    "dmutex.lock.held": ("updowncounter", "{lease}", "Leases held now (granted, not yet ended)"),
    "dmutex.lock.handoffs": (
        "counter",
        "{wake}",
        "Waits of retrying acquires ended by a release's signal",
    ),
}
"""Every instrument: its kind, unit and description (rule 3)."""

LOOK_EVERY = 1.0
"""Seconds between two looks at the global providers while none is configured (rule 2)."""

_SPANNED = {"acquire_with_retry", "run", "run_with_retry"}
# op.state keys: this module's own objects, so no other observer's collide.
_SPAN = object()
_TOKEN = object()


def available() -> bool:
    """Whether ``opentelemetry-api`` can be imported (rule 1)."""
    return importlib.util.find_spec("opentelemetry") is not None


def default(chosen: tuple[Observer, ...]) -> Observer | None:
    """The default OpenTelemetry observer, unless ``chosen`` has one or the API is missing."""
    if any(isinstance(o, OpenTelemetryObserver) for o in chosen) or not available():
        return None
    return _shared()


_DEFAULT: OpenTelemetryObserver | None = None


def _shared() -> OpenTelemetryObserver:
    """One default observer for every instance: its instruments are made once."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = OpenTelemetryObserver()
    return _DEFAULT


class OpenTelemetryObserver:
    """Records dmutex's metrics and spans through OpenTelemetry's global providers.

    Every instance has one by default when ``opentelemetry-api`` is
    installed (the ``dmutex[otel]`` extra); give your own in ``observers=``
    to change its options. ``keys=True`` adds the key to every measurement
    and span (``dmutex.key``): only where keys are few.
    ``meter_provider`` and ``tracer_provider``: record through these
    instead of the global ones (as OpenTelemetry's instrumentations take
    them); either given is taken as configured.
    """

    def __init__(
        self,
        *,
        keys: bool = False,
        meter_provider: MeterProvider | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        from opentelemetry import metrics, trace

        self._metrics = metrics
        self._trace = trace
        self._keys = keys
        self._found = False
        self._next_look = 0.0
        self._given = (meter_provider, tracer_provider)
        self._instruments: dict[str, Histogram] = {}
        self._tracer: Any = None
        self._attributes: dict[tuple[Source, str | None, str | None], dict[str, str]] = {}
        self._tallies: dict[str, dict[tuple[Source, str | None], int]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OpenTelemetryObserver(keys={self._keys})"

    def listening(self) -> bool:
        """Whether a meter or tracer provider is configured (rule 2)."""
        if self._found:
            return True
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + LOOK_EVERY
        given_meters, given_tracers = self._given
        meters = given_meters or self._metrics.get_meter_provider()
        tracers = given_tracers or self._trace.get_tracer_provider()
        if _configured(meters) or _configured(tracers):
            self._start(meters, tracers)
        return self._found

    def _start(self, meters: MeterProvider, tracers: TracerProvider) -> None:
        meter = meters.get_meter("dmutex", __version__)
        for name, (kind, unit, description) in INSTRUMENTS.items():
            if kind == "histogram":
                made = meter.create_histogram(name, unit=unit, description=description)
                self._instruments[name] = made
                continue
            self._tallies[name] = {}
            callbacks = [self._reader(name)]
            if kind == "counter":
                meter.create_observable_counter(name, callbacks, unit, description)
            else:
                meter.create_observable_up_down_counter(name, callbacks, unit, description)
        self._tracer = tracers.get_tracer("dmutex", __version__)
        self._found = True

    def _count(self, name: str, source: Source, key: str, delta: int = 1) -> None:
        """Add ``delta`` to the count ``name`` of (``source``, ``key``) (rule 3)."""
        shown = key if self._keys else None
        with self._lock:
            tally = self._tallies[name]
            tally[(source, shown)] = tally.get((source, shown), 0) + delta

    def _reader(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        """The SDK's callback for the count ``name``: each tally with its attributes."""
        from opentelemetry.metrics import Observation

        def read(_options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                counts = list(self._tallies[name].items())
            return [
                Observation(value, self._attrs(source, shown or ""))
                for (source, shown), value in counts
            ]

        return read

    def _attrs(self, source: Source, key: str, outcome: str | None = None) -> dict[str, str]:
        """The attributes of a measurement, made once per source, key shown and outcome."""
        shown = key if self._keys else None
        found = self._attributes.get((source, shown, outcome))
        if found is None:
            found = {
                "dmutex.service": source.service,
                "dmutex.kind": source.kind,
                "dmutex.backend": source.backend,
            }
            if shown is not None:
                found["dmutex.key"] = shown
            if outcome is not None:
                found["dmutex.outcome"] = outcome
            if len(self._attributes) < 10_000:  # a cache, bounded: keys may be many
                self._attributes[(source, shown, outcome)] = found
        return found

    def __call__(self, event: Event) -> None:
        """Record ``event`` (rules 3 and 4)."""
        if not self._found:
            return
        record = self._instruments
        if isinstance(event, Attempted):
            op = event.operation
            self._count("dmutex.lock.attempts", op.source, op.key)
            if not event.granted:
                self._count("dmutex.lock.refusals", op.source, op.key)
        elif isinstance(event, Started):
            self._started(event.operation)
        elif isinstance(event, Acquired):
            op = event.operation
            wait = self._attrs(op.source, op.key, "acquired")
            record["dmutex.lock.wait.duration"].record(event.waited, wait)
            self._count("dmutex.lock.held", op.source, op.key)
            self._granted(op, event)
        elif isinstance(event, NotAcquired):
            op = event.operation
            wait = self._attrs(op.source, op.key, event.outcome)
            record["dmutex.lock.wait.duration"].record(event.waited, wait)
            self._end(op, event.outcome, event.error, attempts=event.attempts)
        elif isinstance(event, Woken):
            op = event.operation
            self._count("dmutex.lock.handoffs", op.source, op.key)
            span = cast("Span | None", op.state.get(_SPAN))  # what _started put there
            if span is not None:
                span.add_event("dmutex.woken")
        elif isinstance(event, Ended):
            self._end(event.operation, event.outcome, event.error)
        elif isinstance(event, Renewed):
            name = "dmutex.lock.renewals" if event.ok else "dmutex.lock.renewal.failures"
            self._count(name, event.source, event.key)
        elif isinstance(event, (Released, Lost)):
            outcome = "released" if isinstance(event, Released) else "lost"
            hold = self._attrs(event.source, event.key, outcome)
            record["dmutex.lock.hold.duration"].record(event.held, hold)
            self._count("dmutex.lock.held", event.source, event.key, -1)
            if isinstance(event, Lost):
                self._count("dmutex.lock.lost", event.source, event.key)

    def _started(self, op: Operation) -> None:
        if op.name not in _SPANNED:
            return
        attrs: dict[str, Any] = dict(self._attrs(op.source, op.key))
        span = self._tracer.start_span(f"dmutex.{op.name}", attributes=attrs)
        op.state[_SPAN] = span
        if op.name != "acquire_with_retry":
            # A run's span is current while it runs (rule 4).
            from opentelemetry import context

            op.state[_TOKEN] = context.attach(self._trace.set_span_in_context(span))

    def _granted(self, op: Operation, event: Acquired) -> None:
        span = cast("Span | None", op.state.get(_SPAN))  # what _started put there
        details: dict[str, int | float] = {
            "dmutex.attempts": event.attempts,
            "dmutex.wait": event.waited,
        }
        if event.fence is not None:
            details["dmutex.fence"] = event.fence
        if span is not None:  # an acquire_with_retry: its grant ends it
            span.set_attributes(details)
            self._end(op, "acquired", None)
            return
        current = self._trace.get_current_span()
        if current.is_recording():  # inside a run: the run's span, made current
            current.add_event("dmutex.acquired", details)
            if event.fence is not None:
                current.set_attribute("dmutex.fence", event.fence)

    def _end(
        self, op: Operation, outcome: str, error: BaseException | None, attempts: int | None = None
    ) -> None:
        span = cast("Span | None", op.state.pop(_SPAN, None))  # what _started put there
        if span is None:
            return
        token = cast("Token[Context] | None", op.state.pop(_TOKEN, None))
        if token is not None:
            from opentelemetry import context

            context.detach(token)
        span.set_attribute("dmutex.outcome", outcome)
        if attempts is not None:
            span.set_attribute("dmutex.attempts", attempts)
        if outcome == "lost":
            span.add_event("dmutex.lost")
        if outcome in ("lost", "error", "raised"):
            status = self._trace.Status(self._trace.StatusCode.ERROR, outcome)
            span.set_status(status)
            if error is not None:
                span.record_exception(error)
        span.end()


def _configured(provider: Any) -> bool:
    """Whether ``provider`` is one an application set, not the API's proxy or no-op (rule 2)."""
    name = type(provider).__name__
    return "Proxy" not in name and "NoOp" not in name
