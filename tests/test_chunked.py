"""Streamed-chunk attention (kernels/chunked.py) against the reference `attention_lse` +
`merge`, on every path; the CUDA path is forced on CPU tensors under a dispatch mode that
stands in for the CUDA kernels and counts the ops dispatched per streamed chunk."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from triforce_offload.kernels import chunked
from triforce_offload.kernels.attention import attention_lse, merge
from triforce_offload.kernels.chunked import GROUP, StreamedAttention
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.model.transformer import Transformer
from triforce_offload.runtime.cache.offloaded import OffloadedCache

A = torch.ops.aten
NO_KERNEL = {A._unsafe_view.default}  # a view without the schema's alias annotation


class FakeCuda(TorchDispatchMode):
    """Runs the CUDA-only fused attention ops on CPU tensors (the CPU flash kernel, same
    outputs; the efficient kernel's LSE padded to 32 rows with +inf as on CUDA) and counts
    every op that would launch a kernel (views excluded)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and func not in NO_KERNEL:
            self.ops.append(func)
        a = {x.name: args[i] if i < len(args) else kwargs.get(x.name, x.default_value)
             for i, x in enumerate(func._schema.arguments)}
        if func is A._scaled_dot_product_flash_attention.default:
            assert a["query"].dtype in (torch.float16, torch.bfloat16)
            o, lse = self._flash(a)
            return o, lse, None, None, 0, 0, None, None, None
        if func is A._scaled_dot_product_efficient_attention.default:
            assert a["compute_log_sumexp"] and a["attn_bias"] is None
            o, lse = self._flash(a)
            return o, F.pad(lse, (0, -lse.shape[-1] % 32), value=math.inf), None, None
        return func(*args, **kwargs)

    @staticmethod
    def _flash(a):
        q, k, v = a["query"], a["key"], a["value"]
        assert q.shape[1] == k.shape[1] == v.shape[1] and k.stride(-1) == 1
        return chunked._FLASH_CPU(q, k, v, 0.0, a["is_causal"], scale=a["scale"])

    def count(self, op) -> int:
        return sum(f is op for f in self.ops)


def blocks(S, n_kv, D, n, dtype, seed=0):
    """n key blocks of a token-major staging-like buffer [S, B, Hkv, D] as strided views."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, 1, n_kv, D, generator=g).to(dtype)
    v = torch.randn(S, 1, n_kv, D, generator=g).to(dtype)
    cuts = torch.linspace(0, S, n + 1).long().tolist()
    return [(c0, k[c0:c1].permute(1, 2, 0, 3), v[c0:c1].permute(1, 2, 0, 3))
            for c0, c1 in zip(cuts, cuts[1:])]


def reference(q, bl, own, start):
    outs, lses = [], []
    for c0, k, v in bl:
        o, lse = attention_lse(q.float(), k.float(), v.float(), start, c0)
        outs.append(o)
        lses.append(lse)
    o, lse = attention_lse(q.float(), own[0].float(), own[1].float(), start, start)
    return merge(outs + [o], lses + [lse])[0]


@pytest.mark.parametrize("path", ["cuda", "cpu", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,D", [(4, 4, 16), (6, 2, 12), (8, 2, 64), (9, 3, 40)])
@pytest.mark.parametrize("n", [1, 5, GROUP + 3])
def test_streamed_matches_reference(path, dtype, hq, hkv, D, n):
    T, S = 3, 200
    q = torch.randn(1, hq, T, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    bl = blocks(S, hkv, D, n, dtype)
    own = [x[..., :T, :] for x in blocks(T + 1, hkv, D, 1, dtype, seed=2)[0][1:]]
    with FakeCuda():
        acc = StreamedAttention(q, hkv, path=path)
        for _, k, v in bl:
            acc.add(k, v)
        acc.add_causal(*own, S, S)
        got = acc.result(torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, reference(q, bl, own, S), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, A._scaled_dot_product_flash_attention.default),
                                          (torch.float32, A._scaled_dot_product_efficient_attention.default)])
def test_cuda_path_ops_per_chunk(dtype, kernel):
    """The CUDA path per streamed chunk: exactly one fused attention op (flash, or the
    efficient kernel in fp32), K/V never repeated or copied, and one merge of 11 ops per
    GROUP chunks: 1 + 11/GROUP ops per chunk (<= 2), against ~20 for reference + merge."""
    n, hq, hkv, D = 40, 8, 2, 64
    q = torch.randn(1, hq, 4, D).to(dtype)
    bl = blocks(40 * 16, hkv, D, n, dtype)
    with FakeCuda() as mode:
        acc = StreamedAttention(q, hkv, path="cuda")
        setup = len(mode.ops)  # q folded once per layer
        for _, k, v in bl:
            acc.add(k, v)
    per_block = mode.ops[setup:]
    assert mode.count(kernel) == n
    assert not {A.clone.default, A.repeat_interleave.self_int, A._to_copy.default} & set(per_block)
    assert len(per_block) == n + 11 * (n // GROUP)
    assert len(per_block) <= 2 * n and setup <= 1


def test_offloaded_cache_on_the_cuda_path(monkeypatch):
    """The offloaded cache's forwards on the CUDA path (forced on the CPU) equal the
    resident cache's; one fused attention op per streamed chunk."""
    cfg = ModelConfig(vocab_size=97, hidden_size=96, intermediate_size=96, n_layers=3, n_heads=6,
                      n_kv_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 50))
    monkeypatch.setattr(chunked, "default_path", lambda device: "cuda")
    full, off = FullCache(cfg, 64), OffloadedCache(cfg, 64, transfer_chunk=4, on_chip=1)
    with torch.inference_mode(), FakeCuda() as mode:
        outs = []
        for c in (full, off):
            model(ids[:, :40], 0, c)
            c.commit(40)
            mode.ops = []
            outs.append(model(ids[:, 40:44], 40, c))
            c.commit(44)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    # 2 offloaded layers x (10 streamed chunks + the forward's own tokens)
    assert mode.count(A._scaled_dot_product_efficient_attention.default) == 2 * (40 // 4 + 1)
    off.close()
