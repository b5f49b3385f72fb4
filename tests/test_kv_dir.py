"""KV on disk (`--kv-dir`, runtime/cache/disk.py): a saved prefix is loaded instead of
prefilled with the same output; entries of another model, dtype or RoPE are not used and
say why; damaged entries are skipped with a warning; the folder stays within its limit."""
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers_spec import repetitive_prompt, tiny
from triforce_offload.runtime import api
from triforce_offload.runtime.cache.disk import KVDir
from triforce_offload.runtime.cache.prefix import PrefixCache

PROMPT = repetitive_prompt(300, 64)


def opts(mode="triforce", n=12, **extra):
    return api.RunOptions.of(mode=mode, max_new_tokens=n, ignore_eos=True, budget=64, **extra)


def with_dir(L, path, notes, limit=1 << 30):
    L.prefix = PrefixCache(0, KVDir(path, limit, L, notes.append))  # disk only, as `run` has it
    return L


@pytest.mark.parametrize("mode,offload", [("autoregressive", "off"), ("triforce", "off"),
                                          ("retrieval", "on"), ("draft", "on")])
def test_saved_prefix_loads_with_the_same_output(tmp_path, mode, offload):
    L, notes = tiny(vocab=64), []
    o = opts(mode, offload=offload, transfer_chunk=32)
    cold, st = api.generate(with_dir(L, tmp_path, notes), PROMPT, o)
    assert st.extra["reused_tokens"] == 0 and len(list(tmp_path.glob("*.kv"))) == 1
    warm, st = api.generate(with_dir(L, tmp_path, notes), PROMPT, o)  # a new process would see this
    assert st.extra["reused_from"] == "disk" and st.extra["reused_tokens"] == len(PROMPT) - 1
    assert warm == cold and notes == []
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed


def test_another_dtype_rope_or_model_is_not_used(tmp_path):
    notes = []
    api.generate(with_dir(tiny(vocab=64), tmp_path, notes), PROMPT, opts())
    L = with_dir(tiny(vocab=64, seed=1), tmp_path, notes)  # other weights
    assert notes == [f"kv-dir: not using {next(tmp_path.glob('*.kv')).name}: another model "
                     "(weights or config differ)"]
    assert api.generate(L, PROMPT, opts())[1].extra["reused_tokens"] == 0
    notes.clear()
    half = tiny(vocab=64)
    half.model.to(dtype=torch.bfloat16)
    half.dtype = half.kv_dtype = torch.bfloat16  # the entry records the KV dtype
    with_dir(half, tmp_path, notes)
    assert any("dtype float32 (this run: bfloat16)" in n for n in notes), notes
    notes.clear()
    stretched = tiny(vocab=64)
    stretched.cfg.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    with_dir(stretched, tmp_path, notes)
    assert any(": rope theta=" in n and "factor=2.0" in n for n in notes), notes


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_entry_is_skipped_with_a_warning(tmp_path, damage):
    L, notes = tiny(vocab=64), []
    cold = api.generate(with_dir(L, tmp_path, notes), PROMPT, opts())[0]
    f = next(tmp_path.glob("*.kv"))
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF  # one byte of KV: its layer's CRC no longer matches
    else:
        data = bytearray(b"\x00" * 100)
    f.write_bytes(bytes(data))
    out, st = api.generate(with_dir(L, tmp_path, notes), PROMPT, opts())
    assert out == cold and st.extra["reused_tokens"] == 0
    assert len(notes) == 1 and notes[0].startswith(f"kv-dir: skipping {f.name}: "), notes


def test_limit_evicts_least_recently_used(tmp_path):
    L, notes = tiny(vocab=64), []
    with_dir(L, tmp_path, notes)
    prompts = [repetitive_prompt(200, 64, seed=s) for s in range(3)]
    api.generate(L, prompts[0], opts(n=4))
    size = next(tmp_path.glob("*.kv")).stat().st_size
    with_dir(L, tmp_path, notes, limit=int(2.5 * size))
    api.generate(L, prompts[1], opts(n=4))
    for f in tmp_path.glob("*.kv"):
        os.utime(f, (1, 1))  # long ago
    api.generate(L, prompts[0], opts(n=4))  # loads entry 0: now the most recently used
    api.generate(L, prompts[2], opts(n=4))  # a third entry: entry 1 goes
    files = list(tmp_path.glob("*.kv"))
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 2.5 * size
    firsts = {json.loads(f.read_bytes().split(b"\n")[1])["ids"][0] for f in files}
    assert firsts == {prompts[0][0], prompts[2][0]}


# the real model through the CLI: the second run of the same ~3K-token prompt loads its KV

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_json(*args):
    r = subprocess.run([sys.executable, "-m", "triforce_offload.cli", "run", "--json", *args],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.slow
def test_run_kv_dir_twice(tmp_path):
    args = ("--prompt-tokens", "3000", "--max-new-tokens", "8", "--kv-dir", str(tmp_path))
    first, _ = run_json(*args)
    second, err = run_json(*args)
    assert second["reused_from"] == "disk" and second["reused_tokens"] == first["prompt_tokens"] - 1
    assert first["prefill_s"] >= 5 * second["prefill_s"], (first["prefill_s"], second["prefill_s"])
    assert second["text"] == first["text"] and "kv-dir" not in err
    for f in tmp_path.glob("*.kv"):  # a truncated entry: skipped with one line, same text
        f.write_bytes(f.read_bytes()[:-1000])
    third, err = run_json(*args)
    assert third["text"] == first["text"] and third["reused_tokens"] == 0
    assert len([ln for ln in err.splitlines() if ln.startswith("kv-dir: skipping")]) == 1, err
    assert "Traceback" not in err


def test_an_edited_header_is_caught_by_its_crc(tmp_path):
    """The trailer holds the header line's CRC-32: a header that still parses but says other
    things (here: other window spans or token ids would put right KV at wrong positions) is
    skipped with one line, and the run prefills cold."""
    L, notes = tiny(vocab=64), []
    cold = api.generate(with_dir(L, tmp_path, notes), PROMPT, opts())[0]
    f = next(tmp_path.glob("*.kv"))
    magic, head, rest = f.read_bytes().split(b"\n", 2)
    h = json.loads(head)
    h["ids"][-1] = (h["ids"][-1] + 1) % 64  # the prompt still shares every token before it
    f.write_bytes(magic + b"\n" + json.dumps(h).encode() + b"\n" + rest)
    out, st = api.generate(with_dir(L, tmp_path, notes), PROMPT, opts())
    assert out == cold and st.extra["reused_tokens"] == 0
    assert notes == [f"kv-dir: skipping {f.name}: its header is damaged (CRC mismatch)"], notes
