"""The package installs cleanly: a wheel built from the checkout imports from the checkout's
root (where a folder named like the package would shadow it), with its version from the
package metadata, the CLI runnable as a module, and the native kernel's source inside."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True, cwd=out)
    (whl,) = out.glob("triforce_offload-*.whl")
    return whl


def test_wheel_holds_one_import_root_and_the_kernel_source(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert roots == {"triforce_offload"}
    for want in ("runtime/api.py", "offload/store.py", "kernels/cpu_attention.c", "cli/__main__.py",
                 "bench/runner.py", "__init__.py", "settings.py"):
        assert f"triforce_offload/{want}" in names, want


def test_wheel_imports_from_the_checkout_root(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import triforce_offload, triforce_offload.runtime.api as a; "
            "print(a.__file__); print(triforce_offload.__version__)")
    # -c puts the current folder (the checkout's root) first on sys.path, as a user's shell does
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    path, version = r.stdout.split()
    assert Path(path).is_relative_to(site)
    assert version == importlib.metadata.version("triforce-offload")
    assert not (ROOT / "triforce_offload").exists(), "a root folder of the package's name shadows it"
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "run", "--help"], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "--retrieval-chunk" in r.stdout, r.stderr


def test_version_is_written_once():
    setup = (ROOT / "setup.py").read_text()
    (version,) = re.findall(r'version="([^"]+)"', setup)
    assert version == importlib.metadata.version("triforce-offload")
    hits = [p for p in ROOT.glob("*/*.py") if version in p.read_text() and "__version__ =" in p.read_text()]
    assert hits == [], f"version written again in {hits}"
