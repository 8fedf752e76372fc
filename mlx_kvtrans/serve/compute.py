"""The server's one compute thread: MLX work runs on it alone, in the order it comes (a job may
queue its continuation behind what waits), with idle-time jobs (reading a reply in, translating
ahead) run when no job waits. Over sharded models, the compute threads of every process run
the same jobs in step (`lockstep.py`): what comes from outside is a named job, shared."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from .lockstep import Lockstep


class ComputeThread:
    """One daemon thread that runs jobs in the order they come. It never ends: a thread that
    ran MLX's compiled functions aborts the process when it exits during Python's shutdown (its
    thread-local compile cache needs the interpreter to go), so once closed it waits forever and
    goes with the process."""

    def __init__(self, name: str = "kvtrans-compute", named: dict[str, Callable] | None = None,
                 lockstep: Lockstep | None = None):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle: list = []  # jobs for idle time, submitted from this thread only
        self._named = dict(named or {})  # the jobs `share` submits by name
        self._lockstep = lockstep
        self._closed = False
        self._closing = False  # in step, on process 0: the end is shared, nothing more is
        self._ended = threading.Event()  # in step: every process ran its last job
        self.broken: str | None = None  # in step: why the group can no longer run a job
        threading.Thread(target=self._loop_in_step if lockstep else self._loop, name=name,
                         daemon=True).start()

    def every(self, seconds: float, job: Callable) -> None:
        """Submit `job` every `seconds` from a thread of its own (which runs no MLX: the compute
        thread waits without a timeout, see above)."""
        if self._lockstep is not None:
            raise RuntimeError("in step, nothing may run on a clock")

        def tick():
            while not self._closed:
                time.sleep(seconds)
                if not self._closed:
                    self._jobs.put((job, ()))

        threading.Thread(target=tick, name="kvtrans-tick", daemon=True).start()

    def submit(self, job: Callable, *args) -> None:
        if self._lockstep is not None:
            raise RuntimeError("in step, jobs from outside are shared by name (`share`)")
        if self._closed:
            raise RuntimeError("the compute thread is closed")
        self._jobs.put((job, args))

    def share(self, name: str, *args) -> None:
        """Submit the job named `name` with `args`; in step (from process 0 only), every
        process runs it at the same point of its order (`args` picklable)."""
        if self._closed or self._closing:
            raise RuntimeError("the compute thread is closed")
        if self._lockstep is None:
            self._jobs.put((self._named[name], args))
        else:
            self._lockstep.post(name, *args)

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
                later(check)
            else:
                done.set()

        if self._lockstep is None:
            def later(job):
                self._idle.append((job, ()))

            later(check)
            self._jobs.put((lambda: None, ()))  # wakes the loop, which then runs the idle jobs
        else:  # checked between rounds, on process 0 alone
            later = self._lockstep.post_local
            later(check)
        done.wait()

    def close(self) -> None:
        """Run what is queued and what it continues with (`later`), then take no more."""
        if self._closed or self._closing:
            return
        if self._lockstep is not None:  # every process ends at the same round
            self._closing = True
            self._lockstep.post("")
            self._ended.wait()
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

    def wait_ended(self) -> None:
        """In step, on a process other than 0: wait until process 0 closed it and the last
        job ran."""
        self._ended.wait()

    def _loop_in_step(self) -> None:
        """Rounds: the messages shared at its top, then one job, the same on every process.
        The end is the message named ""."""
        self._lockstep.start()
        while True:
            busy = bool(self._idle) or not self._jobs.empty()
            try:
                shared = self._lockstep.exchange(wait=not busy)
            except Exception as e:  # a process of the group is gone: no sharded forward can run
                self._break(str(e) or type(e).__name__)
            for name, args in shared:
                if name == "":
                    self._closed = True  # on every process at this round: no idle job more
                else:
                    self._jobs.put((self._named[name], args))
            self._lockstep.run_local()
            if self._closed and self._jobs.empty():
                self._ended.set()
                threading.Event().wait()  # never returns (see the class)
            if self._idle or not self._jobs.empty():
                self._run_next()

    def _break(self, why: str) -> None:
        """In step, once a process of the group is gone: take no more jobs, end every request
        waiting on process 0 with the reason, and end (`broken` says why)."""
        from .protocol import RequestError

        self.broken = why
        self._closed = True
        if self._lockstep.leader:
            logging.getLogger(__name__).error("the sharded server's group broke: %s", why)
            self._lockstep.fail_all(RequestError(
                f"the sharded server's group broke: {why}", status=503, kind="server_error",
                code="group_broken"))
        self._ended.set()
        threading.Event().wait()  # never returns (see the class)

    def _loop(self) -> None:
        while True:
            self._run_next()

    def _run_next(self) -> None:
        """The next job (an idle job when none waits; else waits for one), run."""
        if self._idle and self._jobs.empty():
            job, args = self._idle.pop(0)
        else:
            job, args = self._jobs.get()
        try:
            job(*args)
        except Exception:  # jobs report their own failures; this one could not
            logging.getLogger(__name__).exception("a compute job failed")
