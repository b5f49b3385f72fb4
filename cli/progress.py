"""Progress bars (stderr) and streamed text output."""
from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .show import err


@contextmanager
def bar(label: str, enabled: bool = True):
    """Yields a callback (done, total) that drives a rich progress bar on stderr."""
    if not enabled:
        yield None
        return
    cols = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*cols, console=err, transient=True) as p:
        task = p.add_task(label, total=None)
        yield lambda done, total: p.update(task, completed=done, total=total)


def print_stream(tokenizer):
    """A per-token callback that prints the decoded text as it grows."""
    toks, shown = [], [0]

    def on_token(t: int):
        toks.append(t)
        s = tokenizer.decode(toks, skip_special_tokens=True)
        if s.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        sys.stdout.write(s[shown[0]:])
        sys.stdout.flush()
        shown[0] = len(s)

    return on_token
