"""Which batch, if any, the current thread's sequence belongs to (a value module: the
graphs module asks it on every step, so it imports nothing of the runtime)."""
from __future__ import annotations

import threading

_local = threading.local()


def current():
    """The `runner.Batcher` whose rendezvous this thread's model forwards go through (None:
    the thread runs alone, every forward at once)."""
    return getattr(_local, "batcher", None)


def enter(batcher, order: int = 0) -> None:
    """This thread is a member of `batcher`'s batch, the `order`-th to join (its prefill
    chunks go before those of members that joined later)."""
    _local.batcher, _local.order = batcher, order


def order() -> int:
    return getattr(_local, "order", 0)


def leave() -> None:
    _local.batcher = None
