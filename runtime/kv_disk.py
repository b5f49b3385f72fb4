"""KV on disk (`--kv-dir`): a run's KV saved with the token ids it belongs to, loaded by a
later run or server of the same model instead of prefilling that prefix.

One file per entry: a magic line, a JSON header line, each layer's K and V of the entry's
N tokens, token-major ([N, B, Hkv, D]) in the KV dtype, and a JSON trailer line with the
CRC-32 of every block (checked on loading: wrong KV would silently change the output). The header names the model (a hash of its weights and of its
config without RoPE), the dtype, the RoPE settings, the cache shape and the token ids; an
entry that differs in any of them is not used (one line says why, once). Files are written
to a temporary name and renamed, so a reader never sees half an entry; a file that does not
parse or is shorter than its header says is skipped with a warning. Loading streams one
layer at a time into the cache (never a second copy of the whole KV in memory). The folder
is kept within `limit` bytes, least recently used entries first.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch


MAGIC = b"TRIFORCE-KV 1\n"
HEADER_MAX = 64 << 20  # a header line longer than this is a damaged file


def longest_prefix(items, prompt: list[int]) -> tuple[object, int]:
    """(key, n) of the (key, ids) item whose int64 `ids` share the longest prefix with
    `prompt`, n at most len(prompt) - 1 (the last prompt token is always prefilled);
    (None, 0) when none shares a token. Kept caches and --kv-dir entries alike."""
    p = np.asarray(prompt, dtype=np.int64)
    best, n_best = None, 0
    for key, ids in items:
        m = min(len(ids), len(p) - 1)
        diff = np.flatnonzero(ids[:m] != p[:m])
        n = int(diff[0]) if diff.size else m
        if n > n_best:
            best, n_best = key, n
    return best, n_best


def holds(ids: np.ndarray, prefix: np.ndarray) -> bool:
    """`prefix` (token ids) is a prefix of `ids`: an entry of `ids` makes one of `prefix` redundant."""
    return len(prefix) <= len(ids) and np.array_equal(ids[:len(prefix)], prefix)


def model_identity(loaded) -> dict:
    """What an entry must match: the model (weights and config), dtype, RoPE and KV shape."""
    cfg = asdict(loaded.cfg)
    theta, scaling = cfg.pop("rope_theta"), cfg.pop("rope_scaling") or {}
    cfg.pop("max_position_embeddings")  # follows the RoPE scaling
    rope = " ".join([f"theta={theta:g}"] + [f"{k}={v}" for k, v in sorted(scaling.items())])
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    with torch.no_grad():
        for name, p in loaded.model.state_dict().items():  # every tensor's name, shape and ends
            flat = p.reshape(-1)
            ends = torch.cat([flat[:256], flat[-256:]]).float().cpu().numpy()
            h.update(f"{name}{tuple(p.shape)}".encode() + ends.tobytes())
    return {"model": h.hexdigest()[:32], "dtype": str(loaded.kv_dtype).removeprefix("torch."),
            "rope": rope,
            "shape": [loaded.cfg.n_layers, 1, loaded.cfg.n_kv_heads, loaded.cfg.head_dim]}


class KVDir:
    def __init__(self, path, limit: int, loaded, note=print):
        self.path, self.limit, self.note = Path(path), limit, note
        self.path.mkdir(parents=True, exist_ok=True)
        self.me = model_identity(loaded)
        self.elem = torch.empty(0, dtype=loaded.kv_dtype).element_size()
        self.dtype = loaded.kv_dtype
        self.told: set[str] = set()  # entries whose reason for being skipped was said
        self.index: dict[str, dict] = {}  # file name -> header of usable entries
        for f in sorted(self.path.glob("*.kv")):
            self._add(f)

    def _say(self, key: str, message: str):
        """`message` once per `key` (an entry's name)."""
        if key not in self.told:
            self.told.add(key)
            self.note(f"kv-dir: {message}")

    def _add(self, f: Path):
        try:
            head = read_header(f)
        except (OSError, ValueError, KeyError) as e:
            return self._say(f.name, f"skipping {f.name}: unreadable or corrupt ({e})")
        why = next((f"{k} {head[k]} (this run: {self.me[k]})" if k != "model"
                    else "another model (weights or config differ)"
                    for k in ("dtype", "rope", "shape", "model") if head[k] != self.me[k]), None)
        if why:
            return self._say(f.name, f"not using {f.name}: {why}")
        head["ids"] = np.asarray(head["ids"], dtype=np.int64)
        self.index[f.name] = head

    def match(self, prompt: list[int]) -> tuple[str | None, int]:
        """The entry sharing the longest prefix with prompt and its length (< len(prompt))."""
        return longest_prefix(((name, head["ids"]) for name, head in self.index.items()), prompt)

    def load(self, name: str, cache, n: int) -> bool:
        """Stream the first n tokens' KV of entry `name` into `cache` (commits n), one
        layer at a time, each checked against its CRC; False, with a warning, when the file
        is gone, short or damaged."""
        f, head = self.path / name, self.index[name]
        L, B, H, D = head["shape"]
        block = len(head["ids"]) * B * H * D * self.elem  # one layer's K (or V)
        try:
            crcs = read_trailer(f, head["offset"] + 2 * L * block)
            buf = torch.empty((2, len(head["ids"]), B, H, D), dtype=self.dtype)  # K, V [N, B, Hkv, D]
            raw = [memoryview(b.view(torch.uint8).numpy()).cast("B") for b in buf]
            with open(f, "rb") as fh:
                fh.seek(head["offset"])
                for layer in range(L):
                    for i in range(2):
                        if fh.readinto(raw[i]) != block or zlib.crc32(raw[i]) != crcs[layer][i]:
                            raise ValueError(f"layer {layer} is damaged")
                    cache.put(layer, 0, *(b[:n].permute(1, 2, 0, 3) for b in buf))
            cache.commit(n)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            self.index.pop(name, None)
            self.note(f"kv-dir: skipping {name}: {e}")
            return False
        os.utime(f)  # most recently used
        return True

    def save(self, cache, ids: list[int]):
        """Write the cache's KV of ids (all committed) as a new entry, unless an entry holds
        them already; entries it contains are removed; then keep within the limit."""
        ids = np.asarray(ids, dtype=np.int64)
        if any(holds(head["ids"], ids) for head in self.index.values()):
            return
        if getattr(cache, "ring", None) is not None:  # entries hold every layer's whole KV
            return self._say("ring", "not saving: the window layers keep only their last "
                             "window of tokens (rings), which entries do not record yet")
        L, B, H, D = self.me["shape"]
        size = 2 * L * len(ids) * B * H * D * self.elem
        if size > self.limit:
            return self._say("limit", f"not saving {len(ids)} tokens' KV ({size / 2**20:.0f} MiB): "
                             "over --kv-dir-limit")
        key = json.dumps(self.me, sort_keys=True).encode() + ids.tobytes()  # model and tokens
        name = hashlib.sha256(key).hexdigest()[:24] + ".kv"
        tmp = self.path / f".{name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(MAGIC + json.dumps({**self.me, "ids": ids.tolist()}).encode() + b"\n")
                crcs = []
                for layer in range(L):
                    crcs.append([])
                    for t in cache.keys(layer, len(ids)):  # [B, Hkv, n, D] -> [n, B, Hkv, D]
                        raw = memoryview(t.permute(2, 0, 1, 3).contiguous().cpu().view(torch.uint8).numpy()).cast("B")
                        fh.write(raw)
                        crcs[-1].append(zlib.crc32(raw))
                fh.write(json.dumps({"crc32": crcs}).encode() + b"\n")
            os.replace(tmp, self.path / name)  # no fsync: after a crash the CRCs catch a torn entry
        except OSError as e:
            tmp.unlink(missing_ok=True)
            return self._say("save", f"could not save an entry: {e}")
        for old in [k for k, h in self.index.items() if holds(ids, h["ids"])]:
            self._remove(old)
        self._add(self.path / name)
        self._evict()

    def _remove(self, name: str):
        self.index.pop(name, None)
        (self.path / name).unlink(missing_ok=True)

    def _evict(self):
        """Delete the least recently used entries (of any model) until within the limit."""
        files = sorted(self.path.glob("*.kv"), key=lambda f: f.stat().st_mtime)
        total = sum(f.stat().st_size for f in files)
        while files and total > self.limit:
            f = files.pop(0)
            total -= f.stat().st_size
            self._remove(f.name)


def read_header(f: Path) -> dict:
    """An entry's header (with `offset`: where its KV starts); ValueError if damaged."""
    with open(f, "rb") as fh:
        if fh.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a KV entry")
        line = fh.readline(HEADER_MAX)
        if not line.endswith(b"\n"):
            raise ValueError("the header is cut short")
        head = json.loads(line)
        head["offset"] = fh.tell()
    for k in ("model", "dtype", "rope", "shape", "ids"):
        if k not in head:
            raise ValueError(f"the header lacks {k!r}")
    return head


def read_trailer(f: Path, at: int) -> list:
    """The CRC-32s [layer][K, V] in the trailer line at byte `at` (where the KV ends)."""
    with open(f, "rb") as fh:
        fh.seek(at)
        line = fh.readline(HEADER_MAX)
    if not line.endswith(b"\n"):
        raise ValueError(f"the file ends early ({f.stat().st_size} bytes; its KV alone takes {at})")
    return json.loads(line)["crc32"]
