"""The server's one compute thread: MLX work runs on it alone, in the order it comes (a job may
queue its continuation behind what waits), with idle-time jobs (reading a reply in, translating
ahead) run when no job waits."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable


class ComputeThread:
    """One daemon thread that runs jobs in the order they come. It never ends: a thread that
    ran MLX's compiled functions aborts the process when it exits during Python's shutdown (its
    thread-local compile cache needs the interpreter to go), so once closed it waits forever and
    goes with the process."""

    def __init__(self, name: str = "kvtrans-compute"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle: list = []  # jobs for idle time, submitted from this thread only
        self._closed = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def every(self, seconds: float, job: Callable) -> None:
        """Submit `job` every `seconds` from a thread of its own (which runs no MLX: the compute
        thread waits without a timeout, see above)."""
        def tick():
            while not self._closed:
                time.sleep(seconds)
                if not self._closed:
                    self._jobs.put((job, ()))

        threading.Thread(target=tick, name="kvtrans-tick", daemon=True).start()

    def submit(self, job: Callable, *args) -> None:
        if self._closed:
            raise RuntimeError("the compute thread is closed")
        self._jobs.put((job, args))

    def later(self, job: Callable, *args) -> None:
        """From a job: run `job` after the jobs waiting now (the next part of a request, the
        next decoding step), also once closed, which waits for it."""
        self._jobs.put((job, args))

    def submit_idle(self, job: Callable, *args) -> None:
        """From a job: run `job` once no submitted job waits (and before any later idle job)."""
        if not self._closed:
            self._idle.append((job, args))

    def settle(self) -> None:
        """Wait until no job and no idle job is left, those they submit included."""
        done = threading.Event()

        def check():
            if self._idle or not self._jobs.empty():
                self._idle.append((check, ()))
            else:
                done.set()

        self._idle.append((check, ()))
        self._jobs.put((lambda: None, ()))  # wakes the loop, which then runs the idle jobs
        done.wait()

    def close(self) -> None:
        """Run what is queued and what it continues with (`later`), then take no more."""
        if self._closed:
            return
        self._closed = True
        drained = threading.Event()

        def drain():
            if self._jobs.empty():
                drained.set()
            else:
                self._jobs.put((drain, ()))

        self._jobs.put((drain, ()))
        drained.wait()

    def _loop(self) -> None:
        while True:
            if self._idle and self._jobs.empty():
                job, args = self._idle.pop(0)
            else:
                job, args = self._jobs.get()
            try:
                job(*args)
            except Exception:  # jobs report their own failures; this one could not
                logging.getLogger(__name__).exception("a compute job failed")
