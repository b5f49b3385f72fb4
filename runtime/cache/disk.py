"""KV on disk (`--kv-dir`): a run's KV saved with the token ids it belongs to, loaded by a
later run or server of the same model instead of prefilling that prefix.

One file per entry: a magic line, a JSON header line, each layer's K and V, token-major
([N, B, Hkv, D]) in the KV dtype, and a JSON trailer line with the CRC-32 of every block
and of the header line (checked on loading: wrong KV, or right KV put at the wrong
positions, would silently change the output). The header names the model
(a hash of its weights and of its config without RoPE), the dtype, the RoPE settings, the
cache shape, the token ids, and each layer's kind (`layers`: full_attention or
sliding_attention) with the `window`; an entry that differs in any of them is not used (one
line says why, once). A global layer's blocks hold all N tokens; a window layer's hold the
positions of `window_held`, a list of [lo, hi) spans: what its ring held at the end ([lo,
N)) and, with --kv-dir, what it held at the end of the prompt (`WindowRing.mark`), one
after the other ([[0, N]] for a cache that keeps window layers whole). An entry serves a
prompt sharing n of its tokens when a span has the band a forward at n reads
(`cache.band_held`: lo <= kv.band_lo(n), and n <= hi): a follow-up extending the
saved conversation, the same prompt again, not a prompt that leaves them earlier (that one
prefills cold, said once). Entries written before layer kinds were recorded (no `layers`)
load for all-global models and are refused for windowed ones.

Files are written to a temporary name and renamed, so a reader never sees half an entry; a
file that does not parse or is shorter than its header says is skipped with a warning.
Loading streams one layer at a time into the cache (never a second copy of the whole KV in
memory). The folder is kept within `limit` bytes, least recently used entries first.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .kv import band_held, band_lo, held_from


MAGIC = b"TRIFORCE-KV 1\n"  # unchanged by `layers`: entries written before it still load
HEADER_MAX = 64 << 20  # a header line longer than this is a damaged file
KINDS = ("full_attention", "sliding_attention")


def longest_prefix(items, prompt: list[int], usable=None) -> tuple[object, int]:
    """(key, n) of the (key, ids) item whose int64 `ids` share the longest prefix with
    `prompt`, n at most len(prompt) - 1 (the last prompt token is always prefilled), of
    those `usable(key, n)` at that n (None: every one); (None, 0) when none shares a token.
    Kept caches and --kv-dir entries alike."""
    p = np.asarray(prompt, dtype=np.int64)
    best, n_best = None, 0
    for key, ids in items:
        m = min(len(ids), len(p) - 1)
        diff = np.flatnonzero(ids[:m] != p[:m])
        n = int(diff[0]) if diff.size else m
        if n > n_best and (usable is None or usable(key, n)):
            best, n_best = key, n
    return best, n_best


def holds(ids: np.ndarray, prefix: np.ndarray) -> bool:
    """`prefix` (token ids) is a prefix of `ids`."""
    return len(prefix) <= len(ids) and np.array_equal(ids[:len(prefix)], prefix)


def covers(ids: np.ndarray, held: list, other: np.ndarray, other_held: list) -> bool:
    """An entry of `ids` whose window layers hold the spans `held` ([lo, hi) each) serves
    every prompt an entry of `other` (with `other_held`) serves: the second one is redundant."""
    return holds(ids, other) and all(any(a <= c and d <= b for a, b in held) for c, d in other_held)


def bands(act: str) -> bool:
    """Whether an entry's window layers were read by a CPU's blocks of positions
    (`kv.band_lo`), from its numerics (prefix.numerics)."""
    return "+window:bands" in act


def serves(held: list, window: int | None, n: int, blocks: bool = True) -> bool:
    """Window layers holding the spans `held` have the band of a forward at n."""
    return any(n <= hi and band_held(lo, window, n, blocks) for lo, hi in held)


def held_spans(cache, n: int) -> list[list[int]]:
    """The spans of [0, n) a cache's window layers hold: its rings' (`held_from`), after
    the positions marked at the end of the prompt (`WindowRing.mark`) where those reach
    further back; [[0, n]] without rings."""
    lo = held_from(cache, n)
    m = cache.ring.marked if cache.ring is not None else None
    if m is None or m[0] >= lo or m[1] > n:
        return [[lo, n]]
    return [[m[0], n]] if m[1] >= lo else [[m[0], m[1]], [lo, n]]


def window_kv(cache, layer: int, held: list):
    """K, V [B, Hkv, S, D] of a window layer's spans one after the other: positions below
    the ring's from the marked copy."""
    lo = held_from(cache, held[-1][1])
    parts = []
    for a, b in held:
        if a < lo:
            m0, _, marked = cache.ring.marked
            parts.append(tuple(t[:, :, a - m0:min(b, lo) - m0] for t in marked[layer]))
        if b > max(a, lo):
            parts.append(cache.recent(layer, max(a, lo), b))
    return tuple(torch.cat(ts, 2) for ts in zip(*parts))


def layer_kinds(cfg) -> list[str]:
    """Each layer's attention kind as it runs (a sliding layer without a window is global)."""
    return [KINDS[w is not None] for w in cfg.windows]


def model_identity(loaded) -> dict:
    """What an entry must match: the model (weights and config), dtype, RoPE, KV shape and
    layer kinds."""
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
    kinds = layer_kinds(loaded.cfg)
    return {"model": h.hexdigest()[:32], "dtype": str(loaded.kv_dtype).removeprefix("torch."),
            "rope": rope,
            "shape": [loaded.cfg.n_layers, 1, loaded.cfg.n_kv_heads, loaded.cfg.head_dim],
            "layers": kinds, "window": loaded.cfg.sliding_window if KINDS[1] in kinds else None}


def spans(head: dict) -> list[list]:
    """The spans [lo, hi) each layer's blocks hold, one after the other: all N tokens of a
    global layer, a window layer's `window_held`."""
    return [[[0, len(head["ids"])]] if kind == KINDS[0] else head["window_held"] for kind in head["layers"]]


def tokens(held: list) -> int:
    return sum(b - a for a, b in held)


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
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            return self._say(f.name, f"skipping {f.name}: unreadable or corrupt ({e})")
        why = next((f"{k} {head[k]} (this run: {self.me[k]})" if k != "model"
                    else "another model (weights or config differ)"
                    for k in ("dtype", "rope", "shape", "model") if head[k] != self.me[k]), None)
        if why is None and "layers" not in head:  # written before entries recorded layer kinds
            if KINDS[1] in self.me["layers"]:
                why = ("written without layer kinds (an older version), and this model has "
                       "window layers")
            head.update(layers=self.me["layers"], window=None, window_held=[[0, len(head["ids"])]])
        why = why or next((f"{k} {head[k]} (this run: {self.me[k]})"
                           for k in ("layers", "window") if head[k] != self.me[k]), None)
        if why:
            return self._say(f.name, f"not using {f.name}: {why}")
        head["ids"] = np.asarray(head["ids"], dtype=np.int64)
        self.index[f.name] = head

    def usable(self, name: str, n: int) -> bool:
        """Entry `name` serves a prompt sharing n of its tokens: its window layers hold the
        band a forward at n reads (`cache.band_held`, the rule of kept caches too)."""
        head = self.index[name]
        return serves(head["window_held"], head["window"], n, bands(head.get("activations", "")))

    def match(self, prompt: list[int], act: str = "") -> tuple[str | None, int]:
        """The usable entry sharing the longest prefix with prompt and its length (<
        len(prompt)). An entry sharing more whose window layers do not hold that prefix's
        band is said once: the prompt leaves the saved tokens where they hold no band."""
        items = []  # `act`: the run's activations (quantized.activations_set); others wrote other KV
        for name, head in self.index.items():  # KV computed with other activations: other values
            if head.get("activations", "") == act:
                items.append((name, head["ids"]))
            else:
                self._say(f"{name} act", f"not using {name}: written with activations "
                          f"{head.get('activations') or 'float (or not recorded)'} (this run: {act or 'float'})")
        name, n = longest_prefix(items, prompt, self.usable)
        other, m = longest_prefix(items, prompt)
        if m > n:
            head = self.index[other]
            held = " and ".join(f"{a}..{b - 1}" for a, b in head["window_held"])
            self._say(f"{other} band", f"not using {other}: the prompt shares {m} of its "
                      f"{len(head['ids'])} tokens, but its window layers hold positions {held} "
                      f"only, not {band_lo(m, head['window'], bands(head.get('activations', '')))}..{m - 1}")
        return name, n

    def load(self, name: str, cache, n: int) -> bool:
        """Stream the KV of entry `name` a forward at n needs into `cache` (commits n):
        positions [0, n) of global layers, a window layer's band, one layer at a time, each
        checked against its CRC; False, with a warning, when the file is gone, short or
        damaged, or when the cache keeps window layers whole and the entry holds some of
        their positions only."""
        f, head = self.path / name, self.index[name]
        L, B, H, D = head["shape"]
        held, N = spans(head), len(head["ids"])
        if cache.ring is None and any(h != [[0, N]] for h in held):
            self.note(f"kv-dir: not loading {name}: this cache keeps window layers whole, "
                      "the entry some of their positions only")
            return False
        try:
            crcs = read_trailer(f, head, head["offset"] + 2 * sum(map(tokens, held)) * B * H * D * self.elem)
            buf = torch.empty((2, N, B, H, D), dtype=self.dtype)  # K, V [N, B, Hkv, D]
            band = None  # the first position window layers were given
            with open(f, "rb") as fh:
                fh.seek(head["offset"])
                for layer, h in enumerate(held):
                    kv = buf[:, :tokens(h)]  # the spans' positions one after the other
                    for i in range(2):
                        raw = memoryview(kv[i].view(torch.uint8).numpy()).cast("B")
                        if fh.readinto(raw) != len(raw) or zlib.crc32(raw) != crcs[layer][i]:
                            raise ValueError(f"layer {layer} is damaged")
                    a, at = 0, 0  # the first position to put, where it is in the block
                    if cache.ring is not None and layer in cache.ring:
                        blocks = bands(head.get("activations", ""))
                        a = band = band_lo(n, head["window"], blocks)
                        k = next((k for k, (lo, hi) in enumerate(h) if serves([[lo, hi]], head["window"], n, blocks)),
                                 None)
                        if k is None:
                            raise ValueError(f"its window layers lack positions {a}..{n - 1}")
                        at = tokens(h[:k]) + a - h[k][0]
                    cache.put(layer, a, *(b[at:at + n - a].permute(1, 2, 0, 3) for b in kv))
            if band is not None:
                cache.ring.hold_from(band)
            cache.commit(n)
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            self.index.pop(name, None)
            self.note(f"kv-dir: skipping {name}: {e}")
            return False
        os.utime(f)  # most recently used
        return True

    def save(self, cache, ids: list[int], act: str = ""):
        """Write the cache's KV of ids (all committed) as a new entry, the window layers'
        as the spans they hold (`held_spans`), unless an entry serves every prompt it would
        (`covers`); entries it covers are removed; then keep within the limit."""
        ids = np.asarray(ids, dtype=np.int64)
        N, window = len(ids), self.me["window"]
        wheld = held_spans(cache, N) if window else [[0, N]]
        if not serves(wheld, window, N, bands(act)):
            return self._say("ring", f"not saving {N} tokens' KV: its window layers' rings "
                             f"no longer hold positions {band_lo(N, window, bands(act))}..{N - 1}")
        if any(covers(head["ids"], head["window_held"], ids, wheld) and head.get("activations", "") == act
               for head in self.index.values()):
            return
        head = {**self.me, "activations": act, "ids": ids.tolist(), "window_held": wheld}
        L, B, H, D = self.me["shape"]
        held = spans(head)
        size = 2 * sum(map(tokens, held)) * B * H * D * self.elem
        if size > self.limit:
            return self._say("limit", f"not saving {N} tokens' KV ({size / 2**20:.0f} MiB): "
                             "over --kv-dir-limit")
        key = json.dumps(self.me, sort_keys=True).encode() + act.encode() + ids.tobytes()  # model and tokens
        name = hashlib.sha256(key + str(wheld).encode()).hexdigest()[:24] + ".kv"
        tmp = self.path / f".{name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                line = json.dumps(head).encode() + b"\n"
                fh.write(MAGIC + line)
                crcs = []
                for layer, kind in enumerate(head["layers"]):
                    crcs.append([])
                    kv = cache.keys(layer, N) if kind == KINDS[0] else window_kv(cache, layer, wheld)
                    for t in kv:  # [B, Hkv, n, D] -> [n, B, Hkv, D]
                        raw = memoryview(t.permute(2, 0, 1, 3).contiguous().cpu().view(torch.uint8).numpy()).cast("B")
                        fh.write(raw)
                        crcs[-1].append(zlib.crc32(raw))
                fh.write(json.dumps({"crc32": crcs, "header": zlib.crc32(line)}).encode() + b"\n")
            os.replace(tmp, self.path / name)  # no fsync: after a crash the CRCs catch a torn entry
        except OSError as e:
            tmp.unlink(missing_ok=True)
            return self._say("save", f"could not save an entry: {e}")
        for old in [k for k, h in self.index.items()
                    if covers(ids, wheld, h["ids"], h["window_held"]) and h.get("activations", "") == act]:
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
    if not isinstance(head, dict):
        raise ValueError("the header is not a JSON object")
    for k in ("model", "dtype", "rope", "shape", "ids"):
        if k not in head:
            raise ValueError(f"the header lacks {k!r}")
    ids, shape = head["ids"], head["shape"]
    if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < 2 ** 63 for t in ids)):
        raise ValueError("the header's ids are not token ids")
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(x) is int and x > 0 for x in shape)):
        raise ValueError(f"the header's shape {shape} is not 4 positive integers")
    if not isinstance(head.get("activations", ""), str):
        raise ValueError("the header's activations is not a string")
    head["crc"] = zlib.crc32(line)  # the trailer's `header`
    if "layers" in head:
        check_kinds(head)
    return head


def check_kinds(head: dict):
    """The layer kinds of a header agree with its shape, and `window_held` with its tokens:
    spans [lo, hi) in order, apart, the last ending at N."""
    kinds, n = head["layers"], len(head["ids"])
    if not isinstance(kinds, list) or len(kinds) != head["shape"][0] or not set(kinds) <= set(KINDS):
        raise ValueError(f"the header's layers are not {head['shape'][0]} of {', '.join(KINDS)}")
    held = head.get("window_held", [[0, n]])
    ends = [x for span in held for x in span] if isinstance(held, list) and all(
        isinstance(span, list) and len(span) == 2 for span in held) else None
    if not (ends and all(type(x) is int for x in ends) and ends[0] >= 0 and ends[-1] == n
            and all(x <= y if i % 2 == 0 else x < y for i, (x, y) in enumerate(zip(ends, ends[1:])))):
        raise ValueError(f"the header's window_held {held} is not spans [lo, hi) in order, "
                         f"the last ending at {n}")
    window = head.get("window")
    if KINDS[1] in kinds and not (type(window) is int and window >= 1):
        raise ValueError(f"the header's window {window} is not a positive integer")
    head["window_held"] = held


def read_trailer(f: Path, head: dict, at: int) -> list:
    """The CRC-32s [layer][K, V] in the trailer line at byte `at` (where the KV ends), once
    the trailer's CRC-32 of the header line matches `head` (entries written before it was
    recorded have none: their header is taken as it parses)."""
    with open(f, "rb") as fh:
        fh.seek(at)
        line = fh.readline(HEADER_MAX)
    if not line.endswith(b"\n"):
        raise ValueError(f"the file ends early ({f.stat().st_size} bytes; its KV alone takes {at})")
    trailer = json.loads(line)
    if "header" in trailer and trailer["header"] != head["crc"]:
        raise ValueError("its header is damaged (CRC mismatch)")
    return trailer["crc32"]
