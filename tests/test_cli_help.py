"""Every command's --help shows each option's help text whole: a bracketed note such as
"[default: torch's]" is rich markup to typer unless escaped, and vanishes from the page."""
import re

import typer
from typer.testing import CliRunner

from triforce_offload.cli.app import app


def _words(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_help_pages_keep_bracketed_notes():
    cmd = typer.main.get_command(app)
    runner = CliRunner()
    checked = 0
    for name, sub in cmd.commands.items():
        notes = [re.sub(r"\\\[", "[", m) for p in sub.params if getattr(p, "help", None)
                 for m in re.findall(r"\\?\[[^\]]*\]", p.help)]
        if not notes:
            continue
        r = runner.invoke(app, [name, "--help"], env={"COLUMNS": "2000", "NO_COLOR": "1"})
        assert r.exit_code == 0, r.output
        page = _words(r.output)
        for note in notes:
            assert _words(note) in page, f"`{name} --help` lost {note!r}"
            checked += 1
    assert checked >= 8  # bench, plan and run have such notes
