"""Which batch, if any, the current thread's sequence belongs to (a value module: the
graphs module asks it on every step, so it imports nothing of the runtime)."""
from __future__ import annotations

import threading

_local = threading.local()


def current():
    """The `runner.Batcher` whose rendezvous this thread's model forwards go through (None:
    the thread runs alone, every forward at once)."""
    return getattr(_local, "batcher", None)


def enter(batcher) -> None:
    _local.batcher = batcher


def leave() -> None:
    _local.batcher = None
