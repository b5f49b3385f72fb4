"""Typed options: the machinery every option type uses, and the environment variables.

An option type is a dataclass of `Options` whose fields are made with `opt()`: each field
holds its default, its check and its help text once. The CLI (`cli/options.py`) turns the
fields into command-line options, the Python API takes the objects as they are, and
`environment()` reads the process environment into `EnvOptions` in this one place.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields, replace

from .errors import TriforceError


def opt(default, help: str, *, check=None, flag: str | None = None, cli: bool = True,
        env: str | None = None, aliases: tuple = ()):
    """A field: `default`, one-line `help`, `check(value) -> None | why it is wrong` (not
    called on None), the CLI `flag` (default --field-name), `cli=False` for API-only
    fields, the environment variable `env` it is read from (EnvOptions), and deprecated
    flag `aliases` the CLI still takes (saying so once)."""
    return field(default=default, metadata=dict(help=help, check=check, flag=flag, cli=cli,
                                                 env=env, aliases=tuple(aliases)))


def flag_of(f) -> str:
    """The command-line spelling of a field: --max-new-tokens for max_new_tokens."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def at_least(n):
    return lambda v: None if v >= n else f"must be >= {n}"


def one_of(*allowed):
    return lambda v: None if v in allowed else f"allowed are {', '.join(map(str, allowed))}"


class Options:
    """Base of the option types: checks every field on construction."""

    def __post_init__(self):
        for f in fields(self):
            check, v = f.metadata.get("check"), getattr(self, f.name)
            why = check(v) if check is not None and v is not None else None
            if why:
                raise TriforceError(f"{flag_of(f)} {v!r}: {why}")
        self.validate()

    def validate(self):
        """Checks that involve several fields (subclasses override)."""

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def but(self, **changes):
        """A copy with `changes`; a name this type does not have is refused."""
        unknown = set(changes) - self.names()
        if unknown:
            raise TriforceError(f"unknown option {sorted(unknown)[0]!r} for {type(self).__name__}; "
                                f"known are {', '.join(sorted(self.names()))}")
        return replace(self, **changes)


def _flag(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(v)


@dataclass(frozen=True)
class EnvOptions(Options):
    """Knobs read from the environment (for tests, kernel selection and CI), all here."""

    cache_dir: str | None = opt(None, "Folder for converted models, tuned profiles and the "
                                "native kernel build [default: ~/.cache/triforce-offload].",
                                env="TRIFORCE_OFFLOAD_CACHE")
    static: bool = opt(False, "Run fixed-shape (graph-path) forwards on the CPU too (tests).",
                       env="TRIFORCE_OFFLOAD_STATIC")
    native: str = opt("auto", "CPU attention kernel: auto (512-bit builds), 1 (always), 0 (never).",
                      check=one_of("auto", "0", "1"), env="TRIFORCE_OFFLOAD_NATIVE")
    native_cflags: str = opt("", "Extra C flags of the native kernel build (sanitizer tests).",
                             env="TRIFORCE_OFFLOAD_NATIVE_CFLAGS")
    linear: str = opt("auto", "CPU linear layers: auto (oneDNN where it works) or torch.",
                      check=one_of("auto", "torch"), env="TRIFORCE_OFFLOAD_LINEAR")
    gpu_linear: str = opt("auto", "CUDA projections of up to 64 rows: auto (the row-exact Triton "
                          "kernel where it runs) or cublas.", check=one_of("auto", "cublas"),
                          env="TRIFORCE_OFFLOAD_GPU_LINEAR")
    cpu_columns: str = opt("auto", "The int8 CPU kernel's weight columns packed once at load for "
                           "calls of 1-63 rows (a second copy of the weights): auto (while they "
                           "fit in an eighth of the available memory), 1 (always), 0 (never).",
                           check=one_of("auto", "0", "1"), env="TRIFORCE_OFFLOAD_CPU_COLUMNS")
    program: str = opt("1", "A CPU step's layers in one native call where they are plain pre-norm "
                       "blocks with int8 activations (runtime/model/program.py): 1, or 0 (a call per "
                       "op of each layer: the same bits).", check=one_of("0", "1"),
                       env="TRIFORCE_OFFLOAD_PROGRAM")
    attention: str = opt("auto", "Fixed-shape attention: auto, flash-attn, triton or sdpa.",
                         check=one_of("auto", "flash-attn", "triton", "sdpa"),
                         env="TRIFORCE_OFFLOAD_ATTENTION")
    tp_timeout: float = opt(300.0, "Seconds a tensor-parallel rank waits for the others.",
                            check=lambda v: None if v > 0 else "must be > 0", env="TRIFORCE_TP_TIMEOUT")

    def cache_root(self):
        from pathlib import Path
        return Path(self.cache_dir or Path.home() / ".cache" / "triforce-offload")


_LOWER = {"native", "linear", "gpu_linear", "cpu_columns", "attention"}  # choices, case-insensitive
_PARSE = {"bool": _flag, "float": float, "str": str, "str | None": lambda v: v or None}


_ENV_FIELDS = {f.name: f for f in fields(EnvOptions)}


def env(name: str):
    """One EnvOptions field, read from os.environ now (tests change the environment between
    calls): a lookup and a cached parse, cheap enough for the attention dispatch that reads
    it on every call."""
    return _env_value(name, os.environ.get(_ENV_FIELDS[name].metadata["env"]))


@functools.lru_cache(maxsize=256)
def _env_value(name: str, raw: str | None):
    """The checked value of field `name` for the variable's text `raw`; a value that does
    not parse or check names its variable."""
    f = _ENV_FIELDS[name]
    if raw is None:
        return f.default
    var = f.metadata["env"]
    try:
        v = _PARSE[f.type](raw.strip().lower() if name in _LOWER else raw)
    except ValueError:
        raise TriforceError(f"{var}={raw!r}: expected a {f.type}") from None
    why = f.metadata["check"](v) if f.metadata["check"] is not None and v is not None else None
    if why:
        raise TriforceError(f"{var}: {why}")
    return v


def environment() -> EnvOptions:
    """Every EnvOptions field from os.environ, read now."""
    return EnvOptions(**{n: env(n) for n in _ENV_FIELDS})
