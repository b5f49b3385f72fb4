"""Models by name through a Hugging Face cache laid out as huggingface_hub lays it out, offline:
`org/name`, `@revision`, `:QUANT`, `org/name/file.gguf`, and the one-line errors."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from triforce_offload.runtime.model import hub
from triforce_offload.runtime.errors import TriforceError
from triforce_offload.runtime.model.loader import model_path


REV = "0123456789abcdef0123456789abcdef01234567"
REV2 = "fedcba9876543210fedcba9876543210fedcba98"


def lay_out(root: Path, repo: str, files: dict[str, Path], rev: str = REV, ref: str | None = "main"):
    """huggingface_hub's cache layout: blobs, a snapshot of links, refs/<ref> naming it."""
    base = root / "hub" / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / rev
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        blob = base / "blobs" / f"{abs(hash((repo, rev, name))):x}"
        shutil.copyfile(src, blob)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, (snap / name).parent), snap / name)
    if ref:
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / ref).write_text(rev)
    return snap


@pytest.fixture
def hf_home(tmp_path, monkeypatch, tiny_model_dir):
    home = tmp_path / "hf"
    folder = {p.name: p for p in Path(tiny_model_dir).iterdir() if p.is_file()}
    lay_out(home, "acme/tiny", folder)
    lay_out(home, "acme/tiny", {**folder}, rev=REV2, ref="v2")
    g = Path(tiny_model_dir) / "model.safetensors"  # any bytes: picking a file reads none of them
    lay_out(home, "acme/tiny-GGUF", {"tiny-Q4_K_M.gguf": g, "tiny-Q8_0.gguf": g,
                                     "big-Q4_0-00001-of-00002.gguf": g, "big-Q4_0-00002-of-00002.gguf": g})
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_names_parse():
    assert hub.parse("org/name") == hub.HubId("org/name")
    assert hub.parse("org/name@v1.0") == hub.HubId("org/name", "v1.0")
    assert hub.parse("org/name-GGUF:Q4_K_M") == hub.HubId("org/name-GGUF", quant="Q4_K_M")
    assert hub.parse("org/name/sub/f.Q8_0.gguf") == hub.HubId("org/name", file="sub/f.Q8_0.gguf")
    for path in ("./org/name", "/abs/path", "~/m", "model.gguf", "a/b/c"):
        assert hub.parse(path) is None, path
    assert [hub.quant_of(n) for n in ("m-Q4_K_M.gguf", "m.Q8_0.gguf", "m-IQ3_XS.gguf", "m-bf16.gguf", "m.gguf")] == \
        ["Q4_K_M", "Q8_0", "IQ3_XS", "BF16", None]


def test_ids_resolve_from_the_cache_offline(hf_home):
    assert model_path("acme/tiny") == hf_home / "hub/models--acme--tiny/snapshots" / REV
    assert model_path("acme/tiny@v2") == hf_home / "hub/models--acme--tiny/snapshots" / REV2
    assert model_path(f"acme/tiny@{REV2}") == hf_home / "hub/models--acme--tiny/snapshots" / REV2
    snap = hf_home / "hub/models--acme--tiny-GGUF/snapshots" / REV
    assert model_path("acme/tiny-GGUF:Q4_K_M") == snap / "tiny-Q4_K_M.gguf"
    assert model_path("acme/tiny-GGUF:q8_0") == snap / "tiny-Q8_0.gguf"
    assert model_path("acme/tiny-GGUF/tiny-Q8_0.gguf") == snap / "tiny-Q8_0.gguf"


def test_errors_are_one_line(hf_home):
    cases = [("nobody/nothing", "not in the Hugging Face cache"),
             ("acme/tiny-GGUF:Q2_K", "has no GGUF file of quantization Q2_K; it has Q4_0, Q4_K_M, Q8_0"),
             ("acme/tiny-GGUF:Q4_0", "is split into several files"),
             ("acme/tiny-GGUF", "has no config.json; it holds GGUF files: name one as acme/tiny-GGUF:QUANT"),
             ("acme/tiny@nope", "not in the Hugging Face cache")]
    for name, want in cases:
        with pytest.raises(TriforceError, match=want.replace("(", r"\(")) as e:
            model_path(name)
        assert "\n" not in str(e.value), name


def test_a_path_that_exists_wins(hf_home, tmp_path, monkeypatch, tiny_model_dir):
    local = tmp_path / "acme" / "tiny"
    shutil.copytree(tiny_model_dir, local)
    monkeypatch.chdir(tmp_path)
    assert model_path("acme/tiny") == Path("acme/tiny")


def test_run_by_name_offline(hf_home):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "run", "--model", "acme/tiny", "--prompt", "Hi",
                        "--max-new-tokens", "3", "--mode", "autoregressive", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "run", "--model", "nobody/nothing", "--prompt", "Hi"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "not in the Hugging Face cache" in r.stderr and "Traceback" not in r.stderr


def test_plan_reads_a_config_by_name(hf_home):
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "plan", "--model", "acme/tiny", "--context",
                        "2048", "--gpus", "4090", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "acme/tiny" in r.stdout


def test_serve_names_the_model_as_given(hf_home, tiny_model_dir):
    from triforce_offload.cli.serve import model_name
    assert model_name("acme/tiny") == "acme/tiny"
    assert model_name("acme/tiny-GGUF:Q4_K_M") == "acme/tiny-GGUF:Q4_K_M"
    assert model_name(str(tiny_model_dir)) == Path(tiny_model_dir).name
