"""Retrieval scoring kernels, the retrieval cache and the streaming cache."""
import pytest
import torch

from triforce_offload.kernels.attention import attention
from triforce_offload.kernels.retrieval import chunk_means, chunk_scores, gather_chunks, top_chunks
from triforce_offload.runtime.cache.kv import FullCache
from triforce_offload.runtime.model.config import ModelConfig
from triforce_offload.runtime.cache.retrieval import RetrievalCache
from triforce_offload.runtime.cache.streaming import StreamingCache


def cfg(layers=1, heads=4, kv=2, d=8):
    return ModelConfig(vocab_size=16, hidden_size=heads * d, intermediate_size=8, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv)


def full_with(K, V):
    c = cfg(kv=K.shape[1], d=K.shape[3], heads=2 * K.shape[1])
    full = FullCache(c, K.shape[2] + 16)
    full.k[0][:, :, : K.shape[2]] = K
    full.v[0][:, :, : K.shape[2]] = V
    full.commit(K.shape[2])
    return c, full


def test_chunk_means_and_gather():
    k = torch.arange(2 * 12, dtype=torch.float32).reshape(1, 2, 12, 1)
    m = chunk_means(k, 4)  # 3 full chunks per head
    assert m[0, 0, :, 0].tolist() == [1.5, 5.5, 9.5]
    g = gather_chunks(k, torch.tensor([[[0, 2], [1, 2]]]), 4)
    assert g[0, 0, :, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert g[0, 1, :, 0].tolist() == [16, 17, 18, 19, 20, 21, 22, 23]


def test_gqa_scores_take_max_over_group():
    means = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # [B=1, Hkv=1, C=2, D=2]
    q = torch.tensor([[[3.0, 0.0], [0.0, 2.0]]])  # two query heads of one group, [1, 2, 2]
    s = chunk_scores(q, means)
    assert s.tolist() == [[[3.0, 2.0]]]  # head 0 likes chunk 0, head 1 chunk 1: both count


def test_top_chunks_keeps_first_and_sorts():
    s = torch.tensor([[[0.0, 5.0, 1.0, 9.0, 3.0]]])
    assert top_chunks(s, 2).tolist() == [[[0, 3]]]
    assert top_chunks(s, 3).tolist() == [[[0, 1, 3]]]
    assert top_chunks(s, 2, keep_first=False).tolist() == [[[1, 3]]]


def test_retrieval_cache_picks_highest_chunks_per_head():
    S, chunk, D = 40, 4, 8
    K = torch.randn(1, 2, S, D) * 0.01
    V = torch.randn(1, 2, S, D)
    K[0, 0, 20:24] += torch.eye(D)[0] * 5  # head 0: chunk 5 points along e0
    K[0, 1, 28:32] += torch.eye(D)[1] * 5  # head 1: chunk 7 points along e1
    K[0, 1, 8:12] += torch.eye(D)[1] * 3  # head 1: chunk 2, second best
    c, full = full_with(K, V)
    q = torch.zeros(1, 4, D)
    q[0, 0, 0] = 1  # query head 0 (KV head 0) looks along e0
    q[0, 3, 1] = 1  # query head 3 (KV head 1) looks along e1
    rc = RetrievalCache(c, budget=8, retrieval_chunk=chunk, extra=8)
    rc.build(full, {0: q}, S)
    assert rc.n_retrieved == 8 and not rc.holds_all  # 40 tokens = 10 full chunks, no tail
    got = rc.k[0][0]  # [Hkv, slots, D]
    assert torch.equal(got[0, :4], K[0, 0, 0:4]) and torch.equal(got[1, :4], K[0, 1, 0:4])  # sink
    assert torch.equal(got[0, 4:8], K[0, 0, 20:24])  # head 0's best chunk
    assert torch.equal(got[1, 4:8], K[0, 1, 28:32])  # head 1's (through query head 3: GQA max)
    rc = RetrievalCache(c, budget=12, retrieval_chunk=chunk, extra=8)
    rc.build(full, {0: q}, S)
    assert torch.equal(rc.k[0][0, 1, 4:12], torch.cat([K[0, 1, 8:12], K[0, 1, 28:32]]))  # top 2, in order


def test_retrieval_cache_holds_all_matches_full_attention_and_rolls_back():
    torch.manual_seed(0)
    S, D = 21, 8  # 5 full chunks of 4 + a tail of 1
    K, V = torch.randn(1, 2, S, D), torch.randn(1, 2, S, D)
    c, full = full_with(K, V)
    rc = RetrievalCache(c, budget=64, retrieval_chunk=4, extra=8)
    rc.build(full, {0: torch.randn(1, 4, D)}, S)
    assert rc.holds_all and rc.n_retrieved == S
    q, k, v = torch.randn(1, 4, 3, D), torch.randn(1, 2, 3, D), torch.randn(1, 2, 3, D)
    want = full.attend(0, q, k, v, S)
    assert torch.allclose(rc.attend(0, q, k, v, S), want, atol=1e-5)
    rc.commit(S + 1)  # keep one, drop two
    q2, k2, v2 = torch.randn(1, 4, 2, D), torch.randn(1, 2, 2, D), torch.randn(1, 2, 2, D)
    full.commit(S + 1)
    assert torch.allclose(rc.attend(0, q2, k2, v2, S + 1), full.attend(0, q2, k2, v2, S + 1), atol=1e-5)


def test_retrieval_cache_tail_and_positions():
    torch.manual_seed(1)
    S, D = 30, 8  # 7 chunks of 4 + tail of 2; budget keeps 2 chunks
    K, V = torch.randn(1, 2, S, D), torch.randn(1, 2, S, D)
    c, full = full_with(K, V)
    rc = RetrievalCache(c, budget=8, retrieval_chunk=4, extra=8)
    rc.build(full, {0: torch.randn(1, 4, D)}, S)
    assert rc.n_retrieved == 10 and torch.equal(rc.k[0][:, :, 8:10], K[:, :, 28:30])  # tail kept
    rc.absorb(full, S, S)
    rc.commit(S)
    assert rc.length == S and rc.room() == 20 - 10  # slots: 2 chunks + 1 tail chunk + 8 extra


def ref_streaming(Ks, Vs, q, pos, sink, window):
    """Attention of one query over sink + the `window` keys before it (explicit selection)."""
    hs = min(sink, pos)
    keep = list(range(hs)) + list(range(max(hs, pos - window), pos + 1))
    return attention(q, Ks[:, :, keep], Vs[:, :, keep], pos, pos - len(keep) + 1)


@pytest.mark.parametrize("sink,window", [(2, 5), (0, 3), (4, 20)])
def test_streaming_cache_matches_sink_plus_window(sink, window):
    torch.manual_seed(2)
    D, N = 8, 30
    Ks, Vs = torch.randn(1, 2, N, D), torch.randn(1, 2, N, D)
    sc = StreamingCache(cfg(), sink, window, pending=8)
    for t in range(N):
        q = torch.randn(1, 4, 1, D)
        out = sc.attend(0, q, Ks[:, :, t: t + 1], Vs[:, :, t: t + 1], t)
        assert torch.allclose(out, ref_streaming(Ks, Vs, q, t, sink, window), atol=1e-5), t
        sc.commit(t + 1)


def test_streaming_cache_rollback_leaves_no_trace():
    torch.manual_seed(3)
    D = 8
    sc = StreamingCache(cfg(), 2, 6, pending=8)
    Ks, Vs = torch.randn(1, 2, 20, D), torch.randn(1, 2, 20, D)
    sc.attend(0, torch.randn(1, 4, 12, D), Ks[:, :, :12], Vs[:, :, :12], 0)
    sc.commit(12)
    junk = torch.randn(1, 2, 3, D)
    sc.attend(0, torch.randn(1, 4, 3, D), junk, junk, 12)  # pending, then rejected
    sc.commit(12)
    q = torch.randn(1, 4, 1, D)
    out = sc.attend(0, q, Ks[:, :, 12:13], Vs[:, :, 12:13], 12)
    assert torch.allclose(out, ref_streaming(Ks, Vs, q, 12, 2, 6), atol=1e-5)
    sc.rollback(10)  # roll back into the window: positions 10, 11, 12 vanish
    q = torch.randn(1, 4, 1, D)
    out = sc.attend(0, q, Ks[:, :, 10:11], Vs[:, :, 10:11], 10)
    keep = [0, 1] + list(range(6, 11))  # evicted tokens stay evicted: 6..9 remain, + 10
    assert torch.allclose(out, attention(q, Ks[:, :, keep], Vs[:, :, keep], 10, 4), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunk_means_of_a_token_major_view_equal_the_fp32_reference(dtype):
    """The host store's [S, B, Hkv, D] layout seen as [B, Hkv, S, D]: fp32 accumulation
    without an fp32 copy gives the reference's means bit for bit (a partial chunk at the
    end is left out)."""
    store = torch.randn(203, 1, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    k = store.permute(1, 2, 0, 3)
    ref = k[:, :, :200].float().reshape(1, 3, 25, 8, 16).mean(3)
    got = chunk_means(k, 8)
    assert got.dtype == torch.float32 and got.shape == (1, 3, 25, 16) and torch.equal(got, ref)
