"""The registry of generation modes: name -> runner, a value module at the bottom of the
runtime (options check a mode's name here; `api` fills in the runners).

A runner is a function (loaded, prompt ids, RunOptions, on_token, progress) -> (new ids,
Stats). The runtime's own are autoregressive and the speculative ones (`api` registers
them when it is imported); code outside it adds comparison modes with `register_mode`
(the benchmark library's `zero-inference`).
"""
from __future__ import annotations

from .errors import TriforceError

BUILTIN = ("triforce", "retrieval", "draft", "autoregressive")  # the runtime's own modes
MODES: dict = {}  # name -> runner


def mode_names() -> list[str]:
    """Every selectable mode: the runtime's own, then registered ones."""
    return list(dict.fromkeys([*BUILTIN, *MODES]))


def register_mode(name: str, runner) -> None:
    """Make `runner` selectable as `RunOptions.mode` (and `run --mode`) under `name`."""
    if MODES.get(name, runner) is not runner:
        raise TriforceError(f"mode {name!r} is registered already")
    MODES[name] = runner
