"""A sampler thread for the fault tests: call a check every so often while a block runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def sampling(sample: Callable[[], None], every: float, name: str) -> Iterator[None]:
    """Call ``sample()`` every ``every`` seconds in a thread named ``name`` while the block runs.

    The thread stops with the block; an exception it raised fails the test there.
    """
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.wait(every):
                sample()
        except Exception as error:  # noqa: BLE001 - ends the sampling; the test reports it
            errors.append(error)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive(), f"the sampler {name} did not stop"
    assert not errors, f"the sampler {name} raised: {errors!r}"
