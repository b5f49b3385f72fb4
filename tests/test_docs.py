"""The docs stay true: generated tables up to date, README short and starting with the
set-up commands, every relative link (and #anchor) pointing at something that exists.
No model is loaded; the table check imports torch once, in a subprocess."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are examples)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_tables_up_to_date():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr + r.stdout


def test_readme_at_most_200_lines():
    n = len(DOCS[0].read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; move detail into docs/"


def test_readme_starts_with_setup_commands():
    """Right under the title: one bash block of `make TARGET` lines, each a Makefile target."""
    lines = [l for l in DOCS[0].read_text().splitlines()[1:] if l.strip()]
    assert lines[0] == "```bash", "README's first block must be the set-up commands"
    block = lines[1: lines.index("```", 1)]
    targets = [l.split("#")[0].split() for l in block]
    assert [t[:1] for t in targets] == [["make"]] * len(block) and len(block) >= 2, block
    makefile = (ROOT / "Makefile").read_text()
    for t in targets:
        assert re.search(rf"^{re.escape(t[1])}:", makefile, re.M), f"no Makefile target {t[1]!r}"
    assert [t[1] for t in targets][:2] == ["demo", "test"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_exist(doc):
    bad = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{doc.name}: " + "; ".join(bad)
