"""Command-line options built from the option types (runtime/options.py).

A command declares a parameter per option type it takes, annotated with the type
(`gen: GenerationOptions`), or with `Annotated[Type, pick("a", "b")]` for a subset of
its fields; `@options` expands each into one typer option per field (flag, default and
help come from the field) and hands the command the constructed, checked objects. The
command's other parameters stay ordinary typer options.
"""
from __future__ import annotations

import functools
import inspect
import types
import typing
from dataclasses import MISSING, fields
from typing import Annotated, Optional, Union

import typer

from ..settings import Options, flag_of
from .show import err

_warned: set[str] = set()


class pick(tuple):
    """`Annotated[T, pick("a", "b")]`: only these fields of T on this command (the rest keep
    their defaults)."""

    def __new__(cls, *names):
        return super().__new__(cls, names)


def _group(hint):
    """(option type, picked names or None) of a parameter annotation, or None."""
    if typing.get_origin(hint) is Annotated:
        base, *meta = typing.get_args(hint)
        names = next((m for m in meta if isinstance(m, pick)), None)
        return (base, names) if isinstance(base, type) and issubclass(base, Options) else None
    return (hint, None) if isinstance(hint, type) and issubclass(hint, Options) else None


def _click_type(t):
    """`int | None` -> Optional[int] (typer reads typing.Optional)."""
    if typing.get_origin(t) in (Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return Optional[args[0]]
    return t


def _params(cls, names, prefix: str) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if not f.metadata.get("cli", True) or (names is not None and f.name not in names):
            continue
        flag = flag_of(f)
        decls = [f"{flag}/--no-{flag[2:]}"] if hints[f.name] is bool else [flag]
        default = f.default if f.default is not MISSING else None
        out.append(inspect.Parameter(f"{prefix}{f.name}", inspect.Parameter.KEYWORD_ONLY,
                                     default=typer.Option(default, *decls, help=f.metadata["help"]),
                                     annotation=_click_type(hints[f.name])))
        for alias in f.metadata.get("aliases", ()):  # deprecated spellings, hidden from --help
            out.append(inspect.Parameter(f"{prefix}{f.name}__{alias.strip('-').replace('-', '_')}",
                                         inspect.Parameter.KEYWORD_ONLY,
                                         default=typer.Option(None, alias, hidden=True),
                                         annotation=Optional[_click_type(hints[f.name])]))
    return out


def _build(cls, prefix: str, kw: dict):
    """The option object from this command's parsed values (popped from kw)."""
    vals = {}
    for f in fields(cls):
        if f"{prefix}{f.name}" in kw:
            vals[f.name] = kw.pop(f"{prefix}{f.name}")
        for alias in f.metadata.get("aliases", ()):
            v = kw.pop(f"{prefix}{f.name}__{alias.strip('-').replace('-', '_')}", None)
            if v is not None:
                _deprecated(alias, flag_of(f))
                vals[f.name] = v
    return cls(**vals)


def _deprecated(alias: str, flag: str):
    if alias not in _warned:
        _warned.add(alias)
        err.print(f"warning: {alias} is deprecated; use {flag}", highlight=False)


def options(fn):
    """Expand fn's option-type parameters into typer options (see the module docstring)."""
    sig, hints = inspect.signature(fn), typing.get_type_hints(fn, include_extras=True)
    groups, params = {}, []
    for p in sig.parameters.values():
        g = _group(hints.get(p.name))
        if g is None:
            params.append(p.replace(annotation=hints.get(p.name, p.annotation),
                                    kind=inspect.Parameter.KEYWORD_ONLY))
        else:
            groups[p.name] = g
            params += _params(g[0], g[1], f"{p.name}__")

    @functools.wraps(fn)
    def wrapper(**kw):
        built = {name: _build(cls, f"{name}__", kw) for name, (cls, _) in groups.items()}
        return fn(**kw, **built)

    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    del wrapper.__wrapped__  # typer must read the expanded signature, not fn's
    return wrapper
