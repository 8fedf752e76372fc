"""Serving models sharded across the processes of an `mx.distributed` group (`mlx.launch ...
kvtrans serve --shard tensor|pipeline`).

Every process runs the same engine, and each forward of a sharded model needs every process at
once, so their compute threads must run the same jobs in the same order. Process 0 answers
HTTP. What reaches the compute thread from outside (a request, a client that left, a model to
load, the end) is a message that process 0 shares with the others at the top of each round of
the compute loop, pickled through `all_sum`, as mlx-lm's own server shares its requests. Every
other job follows from those messages and the models' outputs, which are the same on every
process; nothing a job decides may depend on the clock, so an engine in step keeps every model
resident (`ServeConfig.check`) and every process starts from the same random state.
"""

from __future__ import annotations

import itertools
import pickle
import queue
import threading
from typing import Callable

import mlx.core as mx
import numpy as np

CANCEL = "cancel"  # a message the lockstep applies itself: (CANCEL, request id)


class Lockstep:
    """The messages of process 0's compute loop, shared with every process of `group`."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # process 0: not yet shared
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._watched: dict[int, tuple] = {}  # process 0: id -> (client's event, its emit)
        self._cancelled: dict[int, threading.Event] = {}  # id -> the event jobs read
        self._left_early: set[int] = set()  # ids cancelled before their job started
        self._local: list[Callable] = []  # process 0: this round's `post_local` jobs
        # one random seed everywhere: a sampled token is the same token on every process
        state = mx.distributed.all_sum(mx.random.state[0], group=group)
        self.seed = state.view(mx.uint64).item()

    def start(self) -> None:
        """On the compute thread, before its first job: MLX's random state is per thread."""
        mx.random.seed(self.seed)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def post(self, name: str, *args) -> None:
        """Process 0: share the job registered as `name`, with picklable `args`, next round."""
        self._inbox.put((name, args))

    def post_local(self, job: Callable) -> None:
        """Process 0: run `job` (no MLX) at the top of the next round, on this process only,
        once that round's shared jobs are queued (`run_local`)."""
        self._inbox.put((job, None))

    def watch(self, cancelled: threading.Event, emit: Callable) -> int:
        """Process 0: a request's id; its client's `cancelled` is shared once set."""
        with self._lock:
            rid = next(self._ids)
            self._watched[rid] = (cancelled, emit)
        return rid

    def request(self, rid: int) -> tuple[threading.Event, Callable]:
        """In a shared job, on every process: the request's cancel event (set at the same
        round everywhere) and where its events go (the client's on process 0, nowhere else)."""
        cancelled = threading.Event()
        if rid in self._left_early:  # its client left before its first round
            self._left_early.discard(rid)
            cancelled.set()
        else:
            self._cancelled[rid] = cancelled
        with self._lock:
            client = self._watched.get(rid, (None, None))[1]

        def emit(event) -> None:
            from .records import Failed, Finished

            if isinstance(event, (Finished, Failed)):
                self._cancelled.pop(rid, None)
                with self._lock:
                    self._watched.pop(rid, None)
            if client is not None:
                client(event)

        return cancelled, emit

    def exchange(self, wait: bool) -> list[tuple[str, tuple]]:
        """This round's shared messages, on every process, cancels applied. Process 0 waits
        for one when `wait` (nothing else to run); the others wait for process 0."""
        if not self.leader:
            return self._apply(self._share(None))
        items, messages = [], []
        try:  # what is there now: a local job that posts itself again runs next round
            items.append(self._inbox.get() if wait else self._inbox.get_nowait())
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        for job, args in items:
            if args is None:
                self._local.append(job)
            else:
                messages.append((job, args))
        with self._lock:
            for rid, (event, _) in list(self._watched.items()):
                if event.is_set():
                    messages.append((CANCEL, (rid,)))
                    del self._watched[rid]
        return self._apply(self._share(messages))

    def fail_all(self, error: BaseException) -> None:
        """Process 0, once the group broke: every request it shared and did not finish ends
        with `error` (none of them can run any more)."""
        from .records import Failed

        with self._lock:
            watched, self._watched = list(self._watched.values()), {}
        for _, emit in watched:
            emit(Failed(error))

    def mean(self, values: list[float]) -> list[float]:
        """In a shared job, on every process: each value's mean over the processes."""
        from ..backend.processes import summed

        if not values:
            return []
        return (summed(np.array(values, np.float64), self.group) / self.group.size()).tolist()

    def run_local(self) -> None:
        """Process 0: run the jobs `post_local` gave this round, after its shared jobs were
        queued (a check of what is left sees them)."""
        local, self._local = self._local, []
        for job in local:
            job()

    def _apply(self, messages: list) -> list:
        jobs = []
        for name, args in messages:
            if name == CANCEL:
                event = self._cancelled.pop(args[0], None)
                if event is not None:
                    event.set()
                else:
                    self._left_early.add(args[0])
            else:
                jobs.append((name, args))
        return jobs

    def _share(self, messages: list | None) -> list:
        if self.leader:
            data = mx.array(bytearray(pickle.dumps(messages))) if messages else None
            mx.eval(mx.distributed.all_sum(0 if data is None else data.size, group=self.group))
            if data is not None:
                mx.eval(mx.distributed.all_sum(data, group=self.group))
            return messages
        size = mx.distributed.all_sum(0, group=self.group).item()
        if size == 0:
            return []
        data = mx.distributed.all_sum(mx.zeros(size, dtype=mx.uint8), group=self.group)
        return pickle.loads(bytes(memoryview(data)))
