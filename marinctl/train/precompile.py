"""Compile the schedule's later steps on a background thread while the current one trains.

A schedule change (docs/recipe.md §8) needs a new train step, and its evaluation new eval steps; compiled
at the change, each stalls the run for its whole compile (~11 s each in the tiny demo on 2 CPU cores, minutes
for a large model). XLA's compiler is mostly single-threaded and a compile can run beside a step, so the
trainer hands this class the compiles it will need, in the order it will need them, and takes each
result when it gets there, waiting only for what is not done yet.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

Job = tuple[Hashable, Callable[[], Any]]


class Precompiler:
    """Runs `jobs` (key, build) in order on one thread under `mesh`; `get(key, build)` returns a job's
    result (waiting for it, re-raising its error) or, for a key that was never queued or was cancelled,
    calls `build` itself. `close` cancels the jobs not started and waits for the one running: a run
    that stops (done, preempted, failed) exits only once no compile is in flight."""

    def __init__(self, mesh: Any, jobs: list[Job]) -> None:
        self._mesh = mesh
        self._jobs = list(jobs)
        self._futures: dict[Hashable, Future] = {key: Future() for key, _ in self._jobs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="marinctl-precompile", daemon=True)
        if self._jobs:
            self._thread.start()

    def _work(self) -> None:
        import jax

        with jax.set_mesh(self._mesh):  # meshes are thread-local: the step traces under the run's mesh
            for key, build in self._jobs:
                future = self._futures[key]
                if self._stop.is_set() or not future.set_running_or_notify_cancel():
                    future.cancel()
                    continue
                try:
                    future.set_result(build())
                except BaseException as err:  # handed to whoever asks for this key
                    future.set_exception(err)

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        future = self._futures.get(key)
        if future is None or future.cancelled():
            return build()
        return future.result()

    def close(self) -> None:
        self._stop.set()
        for future in self._futures.values():
            future.cancel()  # a no-op for the running and finished ones
        if self._thread.is_alive():
            self._thread.join()
