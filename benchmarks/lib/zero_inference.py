"""DeepSpeed ZeRO-Inference's KV offload strategy, rebuilt on our model for comparison.

All KV lives in host memory and attention is computed on the host: per layer the queries
go over, the new K/V join the host store, the outputs come back. Importing this module
registers it as the mode `zero-inference` (`run --mode zero-inference`, and a `bench`
contender); the CLI imports it, code calling `api.generate` directly imports it first.
The real DeepSpeed (weights streamed under ZeRO-3) is the `deepspeed` peer in `peers.py`.
"""
from __future__ import annotations

import time

import torch

from ..offload.store import HostKVStore, StoreSpec, check_memory
from ..runtime import api
from ..runtime.cache.kv import KVCache, window_attention
from ..runtime.cache.offloaded import DEVICE_HINT, HOST_HINT


class ZeroInferenceCache(KVCache):
    """ZeRO-Inference KV offload: KV in host memory, attention computed on the host."""

    def __init__(self, cfg, capacity: int, batch: int = 1, dtype=torch.float32, device="cpu"):
        super().__init__(cfg, batch)
        self.capacity, self.device, self.host = capacity, device, torch.device("cpu")
        spec = StoreSpec(list(range(cfg.n_layers)), cfg.n_kv_heads, cfg.head_dim, capacity,
                         batch, dtype, token_major=False)
        check_memory(spec.nbytes(), 0, self.host, HOST_HINT, DEVICE_HINT)
        self.store = HostKVStore(spec)
        self.host_s = 0.0  # seconds in host attention, including the query/output transfers

    def attend(self, layer, q, k, v, start):
        end = self.end_of(q, start)
        t0 = time.perf_counter()
        qh = q.to(self.host)  # queries go over; K/V of the new tokens join the store
        self.store.write(layer, start, k.to(self.host), v.to(self.host))
        K, V = self.store.view(layer, end)
        # a sliding-window layer attends to its band only (Gemma 3): stored whole, read cut
        o = window_attention(qh, K, V, start, 0, self.windows[layer], self.softcap).to(q.device)
        self.host_s += time.perf_counter() - t0
        return o

    def keys(self, layer: int, end: int | None = None):
        return self.store.view(layer, self.length if end is None else end)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def stats(self) -> dict:
        return {"host_attention_s": self.host_s}


def run_zero_inference(loaded: api.Loaded, prompt, opts: api.RunOptions, on_token=None,
                       progress=None):
    """DeepSpeed ZeRO-Inference's KV offload: KV on the host, attention on the host."""
    def make_cache(cap: int) -> ZeroInferenceCache:
        return ZeroInferenceCache(loaded.cfg, cap, dtype=loaded.dtype, device=loaded.device)
    return api.run_with_cache(make_cache, loaded, prompt, opts, on_token, progress)


api.register_mode("zero-inference", run_zero_inference)
