"""A stage-1 fit that survives Ctrl-C and a crash.

A fit of a real pair runs for hours. Between batches `fit` writes its running sums (the
moments, tables, state pairs) to a checkpoint, at most every `every_seconds` and at least ten
times as long apart as a write takes, so a crash loses minutes and huge moments are not
rewritten without end. Ctrl-C is held until the batch in flight is summed: the checkpoint is
written and the fit stops (a second Ctrl-C stops at once). A fit given the same checkpoint,
the same config, recipes and batches, and the same models (`context`) continues after the
last batch written and ends with the translator an unbroken fit makes. Under `mlx.launch`
each process keeps its own sums, in a file of its own, and resumes from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import numpy as np

from .._version import __version__
from ..errors import KvtransError
from ..translators.cross_tokenizer import batch_ids

FILE = "fit-state.pkl"


def state_file(rank: int = 0, size: int = 1) -> str:
    """The checkpoint's file name: one per process of a fit under `mlx.launch`."""
    return FILE if size == 1 else f"fit-state.rank{rank}-of-{size}.pkl"


def holds_checkpoint(directory: Path) -> bool:
    return any(directory.glob("fit-state*.pkl"))


def check_directory(directory: Path, resume: bool, name: str = FILE) -> None:
    """Refuse a checkpoint directory (before anything loads): one holding a checkpoint unless
    resuming, none to resume, or one holding other files."""
    path = directory / name
    if path.exists() and not resume:
        raise KvtransError(f"{directory} holds a fit's checkpoint: pass --resume to continue "
                           "it, or another --workdir")
    if resume and not path.is_file():
        raise KvtransError(f"--resume: {directory} holds no fit checkpoint"
                           + ("" if name == FILE else f" of this process ({name})"))
    # the processes' own files, and writes a crash cut short
    others = sorted(p.name for p in directory.iterdir()
                    if not p.name.startswith("fit-state.")) if directory.is_dir() else []
    if others:
        raise KvtransError(f"--workdir {directory} holds other files ({', '.join(others[:3])}): "
                           "give a new or empty directory for the checkpoints")


class FitCheckpoint:
    def __init__(self, directory: str | Path, resume: bool = False, context: str = "",
                 every_seconds: float = 60.0, rank: int = 0, size: int = 1):
        self.directory = Path(directory)
        self.resume = resume
        self.context = context
        self.every_seconds = every_seconds
        self.name = state_file(rank, size)
        self.key = ""
        self._last, self._cost = time.perf_counter(), 0.0
        self._made: list[Path] = []  # the folders the first save created, deepest first

    @property
    def path(self) -> Path:
        return self.directory / self.name

    def bind(self, config_json: dict, recipes_json: list, batches: list) -> dict | None:
        """Name this fit (config, recipes, every batch's tokens, the models); returns the
        state to continue from when resuming, None when starting."""
        h = hashlib.sha256(json.dumps([config_json, recipes_json, self.context, __version__],
                                      sort_keys=True, default=str).encode())
        for batch in batches:
            for tokens in batch_ids(batch):
                h.update(np.asarray(tokens, dtype=np.int32).tobytes())
        self.key = h.hexdigest()
        check_directory(self.directory, self.resume, self.name)
        if not self.resume:
            return None
        try:
            with open(self.path, "rb") as f:
                state = _SumsUnpickler(f).load()
        except Exception as e:  # a torn, foreign or hostile file: never a traceback
            raise KvtransError(f"{self.path} is unreadable ({type(e).__name__}): start anew "
                               "in another --workdir")
        if not isinstance(state, dict) or state.get("key") != self.key:
            raise KvtransError(f"{self.path} is the checkpoint of another fit (other models, "
                               "options or data): start anew in another --workdir")
        return state

    def due(self) -> bool:
        waited = time.perf_counter() - self._last
        return waited >= max(self.every_seconds, 10 * self._cost)

    def save(self, state: dict) -> None:
        started = time.perf_counter()
        if not self._made:
            missing = self.directory
            while not missing.exists():
                self._made.append(missing)
                missing = missing.parent
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        with open(partial, "wb") as f:
            pickle.dump({**state, "key": self.key}, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, self.path)  # a crash mid-write leaves the previous checkpoint
        self._last = time.perf_counter()
        self._cost = self._last - started

    def clear(self) -> None:
        """The fit is saved: its running sums (possibly gigabytes) go, with the folders made
        to hold them where nothing else came into them."""
        self.path.unlink(missing_ok=True)
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:  # holds something else
                break


class _SumsUnpickler(pickle.Unpickler):
    """Unpickles what a fit's sums are made of and nothing else: numpy arrays and this
    library's classes (moments, tables, recipes), so a checkpoint file cannot run code."""

    NUMPY = {("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.numeric", "_frombuffer"),
             ("numpy.core.numeric", "_frombuffer"), ("numpy._core.multiarray", "_reconstruct"),
             ("numpy.core.multiarray", "_reconstruct")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.NUMPY:
            return super().find_class(module, name)
        if module.startswith("mlx_kvtrans."):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a fit's sums")


@contextlib.contextmanager
def held_interrupt():
    """Yields `interrupted()`: whether Ctrl-C was pressed since. The first press is held (the
    caller stops at a safe point); a second one interrupts at once. Outside the main thread
    nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    pressed = []
    previous = signal.getsignal(signal.SIGINT)

    def hold(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)
