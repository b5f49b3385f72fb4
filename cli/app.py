"""The `triforce-offload` command: the typer `app`, what its commands share (read_prompt)
and the console entry `main`. Each command module (run, plan, tune, bench) imports `app`
from here and registers its command; `cli/__init__.py` imports them all, so importing
anything from `cli` gives the complete command line."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..offload.errors import OffloadError
from ..runtime.errors import TriforceError
from .show import err

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Lossless long-context generation by TriForce speculative decoding "
                       "with an offloaded KV cache.")


def read_prompt(prompt: Optional[str], prompt_file: Optional[Path]) -> Optional[str]:
    """The text of one --prompt or one --prompt-file (the other None), None for neither;
    refuses binary files and empty prompts."""
    if prompt == "-" or (prompt_file is not None and str(prompt_file) == "-"):
        return _nonempty(_utf8(sys.stdin.buffer.read(), "stdin"), "stdin")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise TriforceError(f"--prompt-file {str(prompt_file)!r} does not exist")
        where = f"--prompt-file {str(prompt_file)!r}"
        return _nonempty(_utf8(prompt_file.read_bytes(), where), where)
    return None if prompt is None else _nonempty(prompt, "--prompt")


def read_prompts(prompts: Optional[list[str]], files: Optional[list[Path]]) -> list[str]:
    """Every prompt of repeated --prompt or --prompt-file options, in order (empty: the
    built-in one); stdin ('-') once at most."""
    prompts, files = prompts or [], files or []
    if prompts and files:
        raise TriforceError("give --prompt or --prompt-file, not both")
    if [str(x) for x in prompts + files].count("-") > 1:
        raise TriforceError("stdin ('-') can be read once: give the other prompts as text or files")
    return ([read_prompt(p, None) for p in prompts] if prompts
            else [read_prompt(None, f) for f in files])


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TriforceError(f"{where} is not UTF-8 text (byte {e.start}: "
                            f"{data[e.start:e.start + 1]!r})") from None


def _nonempty(text: str, where: str) -> str:
    """Whitespace alone would run on the chat template alone: a mistake, not a prompt."""
    if not text.strip():
        raise TriforceError(f"{where} is empty; give some prompt text")
    return text


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")):
    """Show torch/CUDA versions, GPUs (PCIe link), CPU, RAM and pinned-memory support."""
    from ..offload.hw import system_info
    from ..runtime.graphs import compile_status
    from .show import show_info
    data = system_info(compile_status)
    if as_json:
        print(json.dumps(data))
    else:
        show_info(data)


def main():
    """Console entry: user mistakes print one line on stderr and exit 2, never a traceback.
    (typer itself reports usage errors with exit 2.)"""
    try:
        app()
    except (TriforceError, OffloadError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)  # the text as is: no markup
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except SystemExit as e:
        if _interrupted(e):  # typer turned Ctrl-C into a silent exit 130
            err.print("interrupted")
        raise
    except MemoryError:
        err.print("[bold red]error:[/] out of host memory; lower --max-context or --budget, "
                  "or use --offload", highlight=False)
        sys.exit(2)


def _interrupted(e: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among the exceptions that led to `e`."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__cause__ or e.__context__
    return False


if __name__ == "__main__":
    main()
