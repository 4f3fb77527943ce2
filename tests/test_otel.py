"""dmutex's OpenTelemetry metrics and spans, read back from the real SDK (issue 29).

A scripted scenario on a :class:`~dmutex.ManualClock`, on InMemoryBackend
and on a real Redis server: three acquires granted, one refused, a
retrying acquire that waits a known time and gives up, one that waits for a
lease to end and gets in, a renewal, a lost lease. The SDK's in-memory
metric reader and span exporter (given to the observer as its providers, so
the process's global ones stay unset) must then hold exactly the expected
figures. And: with the API alone and no SDK the default observer records
nothing and listens to nothing; with an SDK set as the global provider (in
a child process, since the API lets a process set it once) the default
observer of every instance records.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from dmutex import DMutex, InMemoryBackend, ManualClock
from dmutex._observers.otel import INSTRUMENTS, OpenTelemetryObserver
from tests._support.redis_servers import Pool, flushed, newest

SERVICE = "otel"


@dataclass
class Sdk:
    """The SDK's readers, and an observer that records through them."""

    metrics: InMemoryMetricReader
    spans: InMemorySpanExporter
    meters: MeterProvider
    tracers: TracerProvider
    observer: OpenTelemetryObserver

    def points(self) -> dict[tuple[str, tuple[tuple[str, Any], ...]], Any]:
        """Each data point: (instrument, sorted attributes) -> value; a histogram's (count, sum)."""
        found: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}
        data = self.metrics.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        attrs = tuple(sorted((point.attributes or {}).items()))
                        if isinstance(point, HistogramDataPoint):
                            found[(metric.name, attrs)] = (point.count, point.sum)
                        else:
                            found[(metric.name, attrs)] = getattr(point, "value", None)
        return found


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    reader = InMemoryMetricReader()
    exporter = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(exporter))
    meters = MeterProvider(metric_readers=[reader])
    observer = OpenTelemetryObserver(meter_provider=meters, tracer_provider=tracers)
    yield Sdk(reader, exporter, meters, tracers, observer)
    meters.shutdown()
    tracers.shutdown()


def scenario(mutex: DMutex, clock: ManualClock, lose: Any) -> dict[str, Any]:
    """Run the scripted scenario; ``lose(key)`` removes a lease from storage. Its fences."""
    first = mutex.acquire("a", 4)  # 1: granted
    assert first is not None
    assert mutex.acquire("a", 4) is None  # a refusal
    # A retrying acquire that gives up after exactly 2.5 s (the clock's sleeps).
    assert mutex.acquire_with_retry("a", ttl=4, timeout=2.5, retry_delay=1.0) is None
    renewed = mutex.acquire("b", 3, auto_renew=True)  # 2: granted, renewed
    assert renewed is not None
    clock.advance(1.1)  # its first renewal falls due: renewed
    lose("b")
    clock.advance(1.1)  # the next finds it gone: lost, held 2.2 s
    assert renewed.lost
    third = mutex.acquire("c", 10)  # 3: granted, held 0.5 s
    assert third is not None
    clock.advance(0.5)
    assert third.release() is True
    return {"a": first.fence, "b": renewed.fence, "c": third.fence}


def attrs(**more: str) -> tuple[tuple[str, Any], ...]:
    base = {"dmutex.service": SERVICE, "dmutex.kind": "mutex", "dmutex.backend": "memory"}
    return tuple(sorted({**base, **more}.items()))


def check(sdk: Sdk, backend: str, fences: dict[str, Any]) -> None:
    base = dict(attrs())
    base["dmutex.backend"] = backend
    plain = tuple(sorted(base.items()))

    def more(**extra: str) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted({**base, **extra}.items()))

    points = sdk.points()
    attempts = points[("dmutex.lock.attempts", plain)]
    refusals = points[("dmutex.lock.refusals", plain)]
    # 3 grants, 1 refusal, and the retrying acquire's attempts, all refused.
    assert attempts - refusals == 3
    assert refusals >= 1 + 3  # it tried at least at 0, 1, 2 and 2.5 s
    assert points[("dmutex.lock.wait.duration", more(**{"dmutex.outcome": "acquired"}))] == (3, 0)
    assert points[("dmutex.lock.wait.duration", more(**{"dmutex.outcome": "refused"}))] == (1, 0)
    assert points[("dmutex.lock.wait.duration", more(**{"dmutex.outcome": "timeout"}))] == (1, 2.5)
    assert points[("dmutex.lock.renewals", plain)] == 1
    assert ("dmutex.lock.renewal.failures", plain) not in points
    assert points[("dmutex.lock.lost", plain)] == 1
    released = points[("dmutex.lock.hold.duration", more(**{"dmutex.outcome": "released"}))]
    assert released == (1, 0.5)
    assert points[("dmutex.lock.hold.duration", more(**{"dmutex.outcome": "lost"}))] == (1, 2.2)
    # a is still held (never released), b lost, c released.
    assert points[("dmutex.lock.held", plain)] == 1
    assert ("dmutex.lock.handoffs", plain) not in points
    assert {name for name, _ in points} <= set(INSTRUMENTS)

    (span,) = sdk.spans.get_finished_spans()
    assert span.name == "dmutex.acquire_with_retry"
    assert span.attributes is not None
    assert span.attributes["dmutex.outcome"] == "timeout"
    assert span.attributes["dmutex.service"] == SERVICE
    assert span.attributes["dmutex.backend"] == backend
    assert span.attributes["dmutex.attempts"] == refusals - 1
    assert "dmutex.key" not in span.attributes


def test_the_scenario_on_memory(sdk: Sdk) -> None:
    clock = ManualClock()
    backend = InMemoryBackend(clock=clock)
    mutex = DMutex(SERVICE, backend, observers=[sdk.observer])
    fences = scenario(mutex, clock, backend.force_expire)
    check(sdk, "memory", fences)


def test_the_scenario_on_redis(sdk: Sdk, redis_pool: Pool) -> None:
    url = flushed(newest(redis_pool).url)
    clock = ManualClock()
    with redis.Redis.from_url(url) as client:
        mutex = DMutex(SERVICE, client, clock=clock, observers=[sdk.observer])

        def lose(key: str) -> None:
            assert client.delete(f"_dmutex_{SERVICE}:permit:0:{key}") == 1

        fences = scenario(mutex, clock, lose)
    check(sdk, "redis", fences)


def test_a_run_span_is_current_while_it_runs_and_shows_the_fence(sdk: Sdk) -> None:
    from opentelemetry import trace

    mutex = DMutex(SERVICE, InMemoryBackend(), observers=[sdk.observer])
    assert sdk.observer.listening()
    tracer = trace.get_tracer("test", tracer_provider=sdk.tracers)

    def work(handle: Any) -> int:
        with tracer.start_as_current_span("inside"):
            pass
        return int(handle.fence)

    fence = mutex.run("k", work, 10)
    inside, run = sdk.spans.get_finished_spans()
    assert run.name == "dmutex.run"
    assert inside.parent is not None
    assert inside.parent.span_id == run.context.span_id
    assert run.attributes is not None
    assert run.attributes["dmutex.fence"] == fence
    assert run.attributes["dmutex.outcome"] == "ok"
    assert [e.name for e in run.events] == ["dmutex.acquired"]

    def boom(handle: Any) -> None:
        raise KeyError("boom")

    sdk.spans.clear()
    with pytest.raises(KeyError):
        mutex.run_with_retry("k", boom, ttl=10)
    acquiring, failed = sdk.spans.get_finished_spans()
    assert acquiring.name == "dmutex.acquire_with_retry", "its acquire's span, a child"
    assert acquiring.parent is not None
    assert acquiring.parent.span_id == failed.context.span_id
    assert failed.name == "dmutex.run_with_retry"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None
    assert failed.attributes["dmutex.outcome"] == "raised"
    assert trace.get_current_span() is trace.INVALID_SPAN, "the run's span is no longer current"


def test_keys_only_when_asked(sdk: Sdk) -> None:
    observer = OpenTelemetryObserver(
        keys=True,
        meter_provider=sdk.meters,
        tracer_provider=sdk.tracers,
    )
    mutex = DMutex(SERVICE, InMemoryBackend(), observers=[observer])
    assert mutex.acquire("orders", 10) is not None
    keyed = [found for name, found in sdk.points() if name == "dmutex.lock.attempts"]
    assert keyed == [tuple(sorted({**dict(attrs()), "dmutex.key": "orders"}.items()))]


CHILD = textwrap.dedent(
    """
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
    from dmutex import DMutex, InMemoryBackend

    mutex = DMutex("svc", InMemoryBackend())   # made before the SDK is set
    assert not mutex._engine._listened(), "the API alone: nothing listens"
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    import dmutex._observers.otel as otel
    otel._shared()._next_look = 0.0  # found at once, not within the second
    handle = mutex.acquire("k", 10)
    handle.release()
    names = sorted(
        m.name
        for r in reader.get_metrics_data().resource_metrics
        for s in r.scope_metrics
        for m in s.metrics
    )
    print(",".join(names))
    """
)


def test_the_default_observer_records_once_a_global_sdk_is_set() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().split(",") == [
        "dmutex.lock.attempts",
        "dmutex.lock.held",
        "dmutex.lock.hold.duration",
        "dmutex.lock.wait.duration",
    ]


class Counting(redis.Redis):
    """A redis-py client that notes the name of each command it sends."""

    sent: list[str]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent.append(str(args[0]))
        send: Any = super().execute_command  # redis-py leaves it unannotated
        return send(*args, **options)


def test_observing_sends_nothing_to_the_server(sdk: Sdk, redis_pool: Pool) -> None:
    """The same calls, observed by the recording SDK or not, send the same commands."""
    url = flushed(newest(redis_pool).url)
    sent: dict[str, list[str]] = {}
    # The first pass loads the scripts (EVAL, then EVALSHA): both measured passes find them.
    for name, observers in (("warm-up", []), ("plain", []), ("observed", [sdk.observer])):
        client = Counting(connection_pool=redis.ConnectionPool.from_url(url))
        client.sent = []
        try:
            mutex = DMutex(f"{SERVICE}-{name}", client, observers=observers)
            held = mutex.acquire("k", 10)
            assert held is not None
            assert mutex.acquire("k", 10) is None
            assert held.release() is True
            assert mutex.run("k", lambda handle: handle.fence, 10) is not None
        finally:
            client.close()
            client.connection_pool.disconnect()
        sent[name] = client.sent
    assert sent["observed"] == sent["plain"]
    assert sent["plain"], "commands were sent"
    assert sdk.points(), "and the observed lock recorded"
