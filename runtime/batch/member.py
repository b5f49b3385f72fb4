"""Which batch, if any, the current thread's sequence belongs to (a value module: the
graphs module asks it on every step, so it imports nothing of the runtime)."""
from __future__ import annotations

import threading
import time

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


def clock() -> float:
    """Seconds by this thread's clock, what a run prices its levels and forwards by: wall
    time, except that a batch member's waits for its forwards count as what the batch
    charged them (`charge`): a round's shared cost split among its sequences and each one's
    own attention, not the whole round's time, which the other sequences' forwards fill."""
    return time.perf_counter() + getattr(_local, "debt", 0.0)


def charge(waited: float, charged: float) -> None:
    """A forward this thread waited `waited` seconds for was charged `charged` seconds."""
    _local.debt = getattr(_local, "debt", 0.0) + charged - waited
