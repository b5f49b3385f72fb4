"""Bad inputs to the `triforce-offload` command (issue 12): each ends with one line on stderr
(after the model banner, where the run prints one), exit 2, no traceback; Ctrl-C says
`interrupted` and exits 130 with no process left behind."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers_gguf import add_byte_tokenizer
from test_cli import assert_user_error, cli
from triforce_offload.runtime.model import loader
from triforce_offload.runtime.errors import TriforceError


def cli_env(*args, cache, stdin=None):
    """`cli` with its own GGUF cache folder; stdin may be bytes."""
    cmd = [sys.executable, "-m", "triforce_offload.cli", *map(str, args)]
    env = {**os.environ, "TRIFORCE_OFFLOAD_CACHE": str(cache)}
    r = subprocess.run(cmd, capture_output=True, input=stdin, env=env, timeout=300)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(),
                                       r.stderr.decode(errors="replace"))


def stderr_lines(r):
    return [ln for ln in r.stderr.splitlines() if ln.strip()]


def assert_one_line(r, *needles):
    """exit 2, and stderr is the error line alone."""
    assert_user_error(r, *needles)
    assert len(stderr_lines(r)) == 1, r.stderr


def write_tiny_gguf(path, hidden=16, ffn=32, heads=2):
    """A 1-layer random Llama GGUF (fp32) with a byte-level tokenizer: 32 KB."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    tokens = add_byte_tokenizer(w)
    rng = np.random.default_rng(0)
    mats = {"attn_q": (hidden, hidden), "attn_k": (hidden, hidden), "attn_v": (hidden, hidden),
            "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn)}
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), hidden), np.float32))
    for name, shape in mats.items():
        w.add_tensor(f"blk.0.{name}.weight", rng.standard_normal(shape, np.float32) * 0.02)
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "bytes-llama.gguf"
    write_tiny_gguf(path)
    return path


# --- prompts ---------------------------------------------------------------------------------

def test_prompt_file_with_binary_content(tiny_model_dir, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" + bytes(range(256)))
    r = cli("run", "--model", tiny_model_dir, "--prompt-file", f)
    assert_one_line(r, str(f), "is not UTF-8 text")


def test_binary_stdin(tiny_model_dir, tmp_path):
    r = cli_env("run", "--model", tiny_model_dir, "--prompt", "-", cache=tmp_path,
                stdin=b"\xff\xfe\x00\x01")
    assert_one_line(r, "stdin is not UTF-8 text")


@pytest.mark.parametrize("how", ["prompt", "blank prompt", "file", "blank file", "stdin"])
def test_empty_prompt_is_refused(tiny_model_dir, tmp_path, how):
    f = tmp_path / "prompt.txt"
    f.write_text("" if how == "file" else " \n\t\n")
    args = {"prompt": ("--prompt", ""), "blank prompt": ("--prompt", "  \n "),
            "file": ("--prompt-file", f), "blank file": ("--prompt-file", f),
            "stdin": ("--prompt", "-")}[how]
    r = cli_env("run", "--model", tiny_model_dir, *args, cache=tmp_path / "cache", stdin=b"\n")
    assert_one_line(r, "is empty")


# --- GGUF files ------------------------------------------------------------------------------

def _damaged(kind, tiny_gguf, tmp_path):
    out = tmp_path / f"{kind}.gguf"
    if kind == "first-1MB":  # the bundled model cut to its first 1 MB (inside the metadata)
        with open(loader.default_model_path(), "rb") as f:
            out.write_bytes(f.read(1 << 20))
    elif kind == "tensor-data-cut":  # complete metadata, the last tensor's bytes missing
        out.write_bytes(tiny_gguf.read_bytes()[:-100])
    elif kind == "random":
        out.write_bytes(np.random.default_rng(0).bytes(100_000))
    elif kind == "empty":
        out.write_bytes(b"")
    return out


@pytest.mark.parametrize("kind,why", [("first-1MB", "truncated"), ("tensor-data-cut", "truncated"),
                                      ("random", "GGUF magic"), ("empty", "too short")])
def test_damaged_gguf(tmp_path, tiny_gguf, kind, why):
    bad, cache = _damaged(kind, tiny_gguf, tmp_path), tmp_path / "cache"
    r = cli_env("run", "--model", bad, "--prompt", "hi", cache=cache)
    assert_one_line(r, str(bad), "is not a readable GGUF", why)
    assert not cache.exists() or not any(cache.iterdir())  # no partial conversion


def test_failed_conversion_leaves_no_folder(tmp_path, tiny_gguf, monkeypatch):
    """A conversion that fails half-way (disk full, Ctrl-C) leaves nothing in the cache."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path / "cache"))

    def half_way(gguf, out):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"partial")
        raise TriforceError("disk full")

    monkeypatch.setattr(loader, "_dequantize", half_way)
    with pytest.raises(TriforceError, match="disk full"):
        loader.resolve(tiny_gguf)
    assert not any((tmp_path / "cache").iterdir())


def test_tiny_gguf_converts(tmp_path, tiny_gguf, monkeypatch):
    """The check passes a complete GGUF; the conversion lands in one finished folder."""
    monkeypatch.setenv("TRIFORCE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    d = loader.resolve(tiny_gguf)
    assert (d / "done").exists() and [p.name for p in (tmp_path / "cache").iterdir()] == [d.name]


# --- draft model -----------------------------------------------------------------------------

def test_draft_with_another_tokenizer_fails_before_its_weights_load(tiny_model_dir, tiny_gguf,
                                                                    tmp_path):
    """First run of a GGUF draft: the tokenizers are compared before the draft is dequantized,
    so no progress bars precede the error and nothing is written to the cache."""
    cache = tmp_path / "cache"
    r = cli_env("run", "--model", tiny_model_dir, "--draft", tiny_gguf, "--prompt", "Hello there",
                "--max-new-tokens", "4", cache=cache)
    assert_user_error(r, "--draft model's tokenizer differs", "49152 vs 257 tokens")
    banner, error = stderr_lines(r)  # exactly these two lines
    assert banner.startswith("model llama 2 layers") and error.startswith("error:")
    assert not cache.exists() or not any(cache.iterdir())


def test_draft_with_another_tokenizer_and_tp_fails_before_ranks_start(tiny_model_dir, tiny_gguf, tmp_path):
    """With --tp 2 the launcher converts a draft GGUF once, before the ranks would all at
    once: it compares the tokenizers first, so the mismatch is still one line and no rank
    starts."""
    cache = tmp_path / "cache"
    r = cli_env("run", "--model", tiny_model_dir, "--draft", tiny_gguf, "--prompt", "Hello there",
                "--max-new-tokens", "4", "--tp", "2", cache=cache)
    assert_user_error(r, "--draft model's tokenizer differs", "49152 vs 257 tokens")
    assert not cache.exists() or not any(cache.iterdir())


def test_host_memory_is_shared_by_the_ranks_on_a_machine(monkeypatch):
    """Tensor-parallel ranks allocate their host stores at once: each may take its share."""
    from triforce_offload.offload import store
    from triforce_offload.offload.errors import OffloadError
    monkeypatch.setattr(store, "host_available", lambda: 100 * store.GB)
    monkeypatch.setattr(store, "device_available", lambda d: 50 * store.GB)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    store.check_memory(60 * store.GB, 0, "cuda", "h", "d")  # alone: 90 GB of 100 may go
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(OffloadError, match=r"45.0 GB is available \(this rank's share of 2\)"):
        store.check_memory(60 * store.GB, 0, "cuda", "h", "d")


# --- plan ------------------------------------------------------------------------------------

def test_plan_refuses_context_beyond_the_model():
    r = cli("plan", "--gpus", "4090", "--context", "1M", "--host-mem", "1024")
    assert_one_line(r, "context 1048576 exceeds llama2-7b-128k's 131072 tokens",
                    "--rope-scaling linear:8 would stretch it")
    r = cli("plan", "--gpus", "4090", "--context", "1M", "--host-mem", "1024",
            "--rope-scaling", "yarn:4")
    assert_one_line(r, "stretched by --rope-scaling yarn:4", "--rope-scaling yarn:8")


def test_plan_with_rope_scaling_passes_it_on():
    r = cli("plan", "--gpus", "4090", "--context", "256k", "--host-mem", "1024",
            "--rope-scaling", "linear:2")
    assert r.returncode == 0, r.stderr
    cmd = [ln for ln in r.stdout.splitlines() if ln.startswith("triforce-offload run")]
    assert "--rope-scaling linear:2" in cmd[0] and "--max-context 262144" in cmd[0]


def test_plan_reads_the_context_of_a_model_folder(tiny_model_dir):
    r = cli("plan", "--gpus", "4090", "--model", tiny_model_dir, "--context", "3k")
    assert_one_line(r, "exceeds tiny", "2048 tokens", "--rope-scaling linear:2")


# --- Ctrl-C ----------------------------------------------------------------------------------

def _group_alive(pgid: int) -> list[str]:
    """Processes of group `pgid` that are not zombies (Linux /proc)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(pid)
    return alive


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("tp", ["1", "2"])
def test_ctrl_c_says_interrupted(tiny_model_dir, tp):
    """SIGINT to the process group (as a terminal's Ctrl-C) once the run is busy decoding."""
    cmd = [sys.executable, "-m", "triforce_offload.cli", "run", "--model", str(tiny_model_dir),
           "--mode", "autoregressive", "--prompt-tokens", "1500", "--max-new-tokens", "14000",
           "--rope-scaling", "linear:8", "--tp", tp]  # room for ~45 s of decoding: never done first
    # a terminal's process takes SIGINT; a shell's background job (`make test &`) would
    # hand the suite SIGINT ignored, and exec keeps it so
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = p.stderr.readline()  # the banner: loaded, prefilling or decoding now
        assert first.startswith("model "), first + p.stderr.read()
        time.sleep(1.0)
        os.killpg(p.pid, signal.SIGINT)
        rest = p.communicate(timeout=60)[1]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, rest
    assert "Traceback" not in rest
    assert [ln for ln in rest.splitlines() if ln.strip()][-1] == "interrupted", rest
    deadline = time.monotonic() + 10
    while _group_alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(p.pid)


def test_device_index_is_checked_and_made_current(monkeypatch):
    """`--device cuda:N`: N must exist, and becomes the current device (the copy stream's
    waits, events and graph captures follow the current device)."""
    import torch
    from triforce_offload.runtime.api import resolve_device
    from triforce_offload.runtime.errors import TriforceError
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and made == [torch.device("cuda:1")]
    with pytest.raises(TriforceError, match="has 2 CUDA device"):
        resolve_device("cuda:2")
    assert resolve_device("cuda") == torch.device("cuda") and len(made) == 1


def test_error_line_keeps_square_brackets(tiny_model_dir):
    """The error line prints the message as is: rich would read `[x]` as markup and drop it
    (serve's `pip install 'triforce-offload[serve]'` hint lost its extra that way)."""
    r = cli("run", "--model", tiny_model_dir, "--rebuild", "every:[x]")
    assert_user_error(r, "--rebuild 'every:[x]': allowed are")
