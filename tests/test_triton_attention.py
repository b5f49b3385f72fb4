"""The Triton decode/verify kernel against a float64 torch reference.

Without a GPU the kernel runs on CPU tensors under TRITON_INTERPRET=1. That variable only
works if it is set before triton is first imported, and anything in the suite may import
triton first (the attention dispatcher does), so the interpreted cases run once in a child
process (this file as a script) that saves its outputs; the tests here compare them with
the reference. With a GPU the same cases also run in this process on CUDA (marked `cuda`).
Skipped only where triton does not import.
"""
import os
import subprocess
import sys

import pytest
import torch
from helpers_triton import interpreted as interpreted_run

from triforce_offload.kernels import triton_attention as ta

NAN, INF = float("nan"), float("inf")

# head_dim 64/80/128, GQA 1/3/4/8, T 1/2/7/16, lengths off the block, fp32 and bf16, the
# buffer past each length poisoned (NaN, inf, or huge values that would overflow if read).
# name: (B, Hq, Hkv, T, D, S, lens, dtype, poison, kernel kwargs)
CASES = {
    "d64_g1_t1": (1, 4, 4, 1, 64, 300, [237], torch.float32, NAN, {}),
    "d80_g3_t2_huge": (1, 6, 2, 2, 80, 256, [200], torch.float32, 1e30, {}),
    "d128_g4_t7_b2": (2, 8, 2, 7, 128, 200, [133, 61], torch.float32, NAN, {}),
    "d64_g8_t16": (1, 8, 1, 16, 64, 700, [555], torch.float32, NAN, {}),
    "bf16_d128_g4_t1": (1, 4, 1, 1, 128, 400, [389], torch.bfloat16, NAN, {}),
    "bf16_d80_g3_t7_b2": (2, 3, 1, 7, 80, 160, [150, 97], torch.bfloat16, INF, {}),
    "bf16_d64_g4_t16": (1, 8, 2, 16, 64, 300, [290], torch.bfloat16, NAN, {}),
    # fp16 runs the 16-bit tl.dot path (p rounded to 16 bits) even under the interpreter,
    # which cannot multiply bf16 tiles (see triton_attention.decode_attention_lse)
    "fp16_d80_g8_t2": (1, 8, 1, 2, 80, 333, [301], torch.float16, INF, {}),
    "fp16_d128_g3_t16": (1, 3, 1, 16, 128, 250, [222], torch.float16, NAN, {}),
    # G*T = 144 rows: two row blocks of 128
    "rows_2blocks": (1, 16, 1, 9, 64, 150, [140], torch.float32, NAN, {}),
    # streamed chunks of an offloaded cache: every query sees [0, length)
    "noncausal_fp32": (2, 8, 2, 7, 80, 256, [177, 5], torch.float32, NAN, dict(causal=False, splits=3)),
    "noncausal_bf16": (2, 8, 2, 7, 80, 256, [177, 5], torch.bfloat16, NAN, dict(causal=False, splits=3)),
    # one split; more splits than blocks
    "splits1": (1, 6, 2, 2, 64, 200, [150], torch.float32, NAN, dict(splits=1, block_n=16)),
    "splits64": (1, 6, 2, 2, 64, 200, [150], torch.float32, NAN, dict(splits=64, block_n=16)),
    # a length shorter than T: the first rows see no key (out 0, lse -inf)
    "short_b2": (2, 4, 2, 7, 64, 128, [100, 3], torch.float32, NAN, {}),
    # an explicit first query position, as an int or a device tensor: valid keys past
    # q_pos0 + t stay unseen
    "qpos_int": (2, 4, 2, 7, 64, 128, [100], torch.float32, NAN, dict(q_pos0=40)),
    "qpos_tensor": (2, 4, 2, 7, 64, 128, [100], torch.float32, NAN, dict(q_pos0=[40, 90])),
    "scale": (1, 4, 2, 1, 64, 100, [70], torch.float32, NAN, dict(scale=0.3)),
    "strided": (1, 6, 2, 2, 64, 200, [150], torch.float32, NAN, dict(strided=True, splits=5)),
}


def make(name, device="cpu"):
    """q, k, v, length and the kernel kwargs of a case; k, v poisoned past each length."""
    B, Hq, Hkv, T, D, S, lens, dtype, poison, kw = CASES[name]
    kw = dict(kw)
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    if kw.pop("strided", False):  # q as [B, T, Hq, D], K/V as views of a [2, B, S+10, Hkv, D] store
        q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
        store = torch.randn(2, B, S + 10, Hkv, D, generator=g).to(dtype)
        store[:, :, lens[0]:] = poison
        k, v = (store[i, :, :S].transpose(1, 2) for i in range(2))
    else:
        k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
        v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
        for b, n in enumerate(lens):
            k[b, :, n:] = poison
            v[b, :, n:] = poison
    length = torch.tensor(lens, dtype=torch.int32 if len(lens) > 1 else torch.int64)
    if isinstance(kw.get("q_pos0"), list):
        kw["q_pos0"] = torch.tensor(kw["q_pos0"], dtype=torch.int32, device=device)
    kw.setdefault("block_n", 32)
    return q.to(device), k.to(device), v.to(device), length.to(device), kw


def run(name, device="cpu"):
    q, k, v, length, kw = make(name, device)
    out, lse = ta.decode_attention_lse(q, k, v, length, **kw)
    return out.cpu(), lse.cpu()


def reference(q, k, v, length, q_pos0=None, causal=True, scale=None, **_):
    """float64: out [B, Hq, T, D], lse [B, Hq, T]; out 0 / lse -inf for a row with no key."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    lens = length.expand(B).tolist()
    pos0 = [n - T for n in lens] if q_pos0 is None else torch.as_tensor(q_pos0).expand(B).tolist()
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((B, Hq, T), -INF, dtype=torch.float64)
    for b in range(B):
        n = lens[b]
        kb = k[b, :, :n].double().repeat_interleave(G, 0)  # [Hq, n, D]
        vb = v[b, :, :n].double().repeat_interleave(G, 0)
        s = q[b].double() @ kb.transpose(-1, -2) * scale  # [Hq, T, n]
        if causal:
            last = pos0[b] + torch.arange(T)
            s = s.masked_fill(torch.arange(n)[None, :] > last[:, None], -INF)
        row_lse = torch.logsumexp(s, -1)
        seen = torch.isfinite(row_lse)
        p = torch.exp(s - torch.where(seen, row_lse, 0.0)[..., None])
        out[b] = torch.where(seen[..., None], p @ vb, 0.0)
        lse[b] = row_lse
    return out, lse


def check(name, out, lse):
    q, k, v, length, kw = make(name)
    ref_out, ref_lse = reference(q, k, v, length, **kw)
    low = q.dtype in (torch.bfloat16, torch.float16)  # 16-bit: p and out rounded
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert torch.isfinite(out).all()
    tol = dict(atol=3e-2, rtol=3e-2) if low else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3 if low else 2e-5, rtol=0)
    return ref_lse


def _interpreted_main(path):
    """Child process: every case on CPU tensors under the interpreter, saved to `path`."""
    assert ta.available(), ta.reason()
    torch.save({name: run(name) for name in CASES}, path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    if ta.triton is None:
        pytest.skip(ta.reason())
    return interpreted_run(__file__, tmp_path_factory.mktemp("triton"))


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted, name):
    ref_lse = check(name, *interpreted[name])
    if name == "short_b2":  # the first 4 rows of batch 1 (length 3, T 7) see no key
        assert torch.isneginf(ref_lse[1, :, :4]).all()
        assert (interpreted[name][0][1, :, :4] == 0).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or ta.triton is None, reason="needs triton and a GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_matches_reference(name):
    check(name, *run(name, "cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or ta.triton is None, reason="needs triton and a GPU")
def test_cuda_graph_replay_follows_the_device_length():
    """Captured once, replayed after the length tensor changed: shapes never change."""
    q, k, v, length, kw = make("d128_g4_t7_b2", "cuda")
    ta.decode_attention_lse(q, k, v, length, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = ta.decode_attention_lse(q, k, v, length, **kw)
    k[:, :, 133:140].normal_()
    v[:, :, 133:140].normal_()
    length.copy_(torch.tensor([140, 61], device="cuda"))
    graph.replay()
    ref_out, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), length.cpu())
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=2e-5, rtol=0)


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from triforce_offload.kernels import triton_attention as ta\n"
            "assert not ta.available(); print(ta.reason())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr
    assert "not importable" in r.stdout


if __name__ == "__main__":
    _interpreted_main(sys.argv[1])
