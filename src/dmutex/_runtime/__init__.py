"""What runs the engine against real I/O, threads and tasks.

- ``drivers.py``: the sync and asyncio drivers, which carry out an
  operation's effects (requests, sleeps, waits, callbacks) and prepare the
  store once per instance;
- ``renewers.py``: the timekeeper thread and tasks, and the workers that run
  renewals and watch deadlines for the handles.

Both decide nothing (the engine in ``dmutex._core`` does); both sit below the
public classes in ``dmutex._faces`` and above ``_core`` and ``_backends``,
whose stores they drive.
"""
