"""Paged decode attention (split-KV) against a float32 torch reference that gathers K/V by block table."""
import math

import pytest
import torch

TOL = dict(atol=2e-2, rtol=2e-2)


def reference(q, k_cache, v_cache, block_tables, context_lens, nq):
    """[num_seqs, nq * hd] fp32: softmax(q K^T / sqrt(hd)) V per sequence; length 0 gives zeros."""
    _, block_size, nkv, hd = k_cache.shape
    out = torch.zeros(q.shape[0], nq * hd, device=q.device)
    for s, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[s, : math.ceil(length / block_size)].long()
        k = k_cache[blocks].reshape(-1, nkv, hd)[:length].float()  # [L, nkv, hd]
        v = v_cache[blocks].reshape(-1, nkv, hd)[:length].float()
        qs = q[s, : nq * hd].float().view(nkv, nq // nkv, hd)
        p = (torch.einsum("kgd,lkd->kgl", qs, k) / math.sqrt(hd)).softmax(-1)
        out[s] = torch.einsum("kgl,lkd->kgd", p, v).reshape(-1)
    return out


def make_inputs(lens, nq, nkv, hd, block_size, max_context_len, full_tables=False):
    """Random q rows (laid out like qkv rows, so q_stride > nq * hd), a cache whose slots outside
    any sequence hold NaN, and block tables made of shuffled blocks, unused entries -1."""
    dev = "cuda"
    width = math.ceil(max_context_len / block_size)
    per_seq = [width if full_tables else math.ceil(n / block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    k_cache = torch.randn(num_blocks, block_size, nkv, hd, device=dev).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, nkv, hd, device=dev).bfloat16()
    order = torch.randperm(num_blocks, device=dev).to(torch.int32)
    block_tables = torch.full((len(lens), width), -1, dtype=torch.int32, device=dev)
    in_use = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=dev)
    start = 0
    for s, (n, length) in enumerate(zip(per_seq, lens)):
        blocks = order[start : start + n]
        start += n
        block_tables[s, :n] = blocks
        slots = (blocks[:, None].long() * block_size + torch.arange(block_size, device=dev)).flatten()
        in_use[slots[:length]] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, nkv, hd)[~in_use] = float("nan")
    q = (2 * torch.randn(len(lens), (nq + 2 * nkv) * hd, device=dev)).bfloat16()
    context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = torch.full((len(lens), nq * hd), float("nan"), device=dev).bfloat16()
    return q, k_cache, v_cache, block_tables, context_lens, out


def run_and_check(lens, nq, nkv, hd, block_size, max_context_len):
    from nanograph import ops

    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs(
        lens, nq, nkv, hd, block_size, max_context_len)
    ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, nq,
                               hd**-0.5, max_context_len)
    torch.cuda.synchronize()
    ref = reference(q, k_cache, v_cache, block_tables, context_lens, nq)
    torch.testing.assert_close(out.float(), ref, **TOL)
    empty = context_lens == 0
    assert (out[empty] == 0).all(), "rows of context length 0 must be exactly zero"


def captured(fn):
    """A CUDA graph of fn, captured after one warm-up call on a side stream (outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def random_lens(n, high, seed, zeros=()):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, high + 1, (n,), generator=g).tolist()
    for i in zeros:
        lens[i] = 0
    return lens


# (id, context lengths, nq, nkv, head_dim, block_size, max_context_len >= every length, as in a
# graph captured for the longest context and replayed with shorter ones)
CASES = [
    ("q8kv8_edges", [1, 15, 16, 17, 4096, 0], 8, 8, 128, 16, 8192),
    ("q16kv8_hd64_bs256", [1, 255, 256, 257, 4096, 0, 77], 16, 8, 64, 256, 4608),
    ("q32kv8_batch64", random_lens(64, 4096, 0, zeros=(5,)), 32, 8, 128, 16, 4096),
    ("q32kv8_batch64_bs256", random_lens(64, 4096, 1), 32, 8, 128, 256, 4096),
    ("q8kv1", [3000, 1, 0, 255, 257], 8, 1, 128, 256, 4096),
    ("q28kv4", random_lens(7, 2048, 2), 28, 4, 128, 16, 2048),
    ("q32kv2_ratio16_hd64", random_lens(9, 1000, 3, zeros=(0,)), 32, 2, 64, 32, 1024),
    ("q32kv8_32768", [32768], 32, 8, 128, 256, 32768),
    ("q16kv2_hd64_32768", [32768, 5, 0], 16, 2, 64, 16, 32768),
    ("q32kv8_batch256_one_split", random_lens(256, 1024, 4, zeros=(3, 200)), 32, 8, 128, 16, 2048),
    ("q8kv2_hd64_batch64_bs64", random_lens(64, 4096, 5), 8, 2, 64, 64, 4096),
    ("q4kv4_all_empty", [0, 0], 4, 4, 128, 16, 512),
    ("q8kv8_max_len_0", [0], 8, 8, 64, 16, 0),
    # Grids of at most 264 CTAs, which load their first keys before the PDL wait (batch 1 to 4
    # at a latency benchmark's max_model_len).
    ("q16kv8_batch1_small_grid", [383], 16, 8, 128, 16, 400),
    ("q16kv8_batch4_small_grid", [1, 17, 200, 400], 16, 8, 128, 16, 400),
    ("q32kv8_hd64_small_grid", [100, 64, 0, 65], 32, 8, 64, 16, 512),
    ("q16kv8_bs256_small_grid", [700, 1], 16, 8, 128, 256, 1024),
    # 128 splits x 2 kv heads: 256 CTAs of 128 keys, so warps take a second step.
    ("q16kv2_long_small_grid", [16000], 16, 2, 128, 16, 16384),
    # Small grids of several chunks (one cluster of CTAs per 2,048 keys of a sequence), merged through the
    # workspace: a long sequence beside short ones under the model's whole bound.
    ("q16kv8_batch1_chunks_40960", [40960], 16, 8, 128, 16, 40960),
    ("q16kv8_batch2_chunks", [9000, 2049], 16, 8, 128, 16, 32768),
    ("q32kv8_hd64_batch1_chunks", [5000], 32, 8, 64, 16, 16384),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,block_size,max_len", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_matches_reference(lens, nq, nkv, hd, block_size, max_len):
    torch.manual_seed(len(lens) * 1000 + nq)
    run_and_check(lens, nq, nkv, hd, block_size, max_len)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [random_lens(300, 2048, 6, zeros=(0, 7, 299)), [5, 5, 0, 9, 9, 9, 1, 0],
                                  [0] * 4, [42], []],
                         ids=["300_with_ties_and_zeros", "ties", "all_zero", "one", "none"])
def test_order_by_length_is_a_stable_descending_sort(lens):
    from nanograph import ops

    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    order = torch.full((len(lens),), -1, dtype=torch.int32, device="cuda")
    ops.order_by_length(context_lens, order)
    # Stable: equal lengths keep index order (sort by length descending, then index ascending).
    expected = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    assert order.tolist() == expected


# Large grids (which read the order) and a small one (which ignores it).
@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,block_size,max_len", [
    (random_lens(256, 2048, 7, zeros=(9,)), 16, 8, 128, 16, 2048),
    (random_lens(64, 4096, 8), 32, 8, 128, 16, 4096),
    ([383, 17], 16, 8, 128, 16, 400)], ids=["batch256", "batch64_split", "small_grid"])
def test_sequence_order_changes_no_result(lens, nq, nkv, hd, block_size, max_len):
    """The same output, bit for bit, with the sequences taken longest first or in a random order as without
    an order: a CTA's work depends on its sequence, not on when it starts."""
    from nanograph import ops

    torch.manual_seed(len(lens))
    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs(lens, nq, nkv, hd, block_size, max_len)
    assert plan(len(lens), nq, nkv, hd, max_len)["reads_order"] == (len(lens) > 2)
    ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, nq, hd**-0.5, max_len)
    longest_first = torch.empty_like(context_lens)
    ops.order_by_length(context_lens, longest_first)
    shuffled = torch.randperm(len(lens), device="cuda").to(torch.int32)
    for order in (longest_first, shuffled):
        again = torch.full_like(out, float("nan"))
        ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, again, nq, hd**-0.5, max_len,
                                   seq_order=order)
        assert torch.equal(again, out)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, block_tables, context_lens, nq), **TOL)
    # An order that is no permutation shows whether the grid reads it: every CTA of a large unsplit grid then
    # serves sequence 0, so only row 0 is written; a small grid ignores it. (A split grid's CTAs would all count
    # on sequence 0's arrivals, which breaks the kernel's contract.)
    layout = plan(len(lens), nq, nkv, hd, max_len)
    if layout["reads_order"] and layout["splits"] > 1:
        return
    zeros = torch.zeros_like(context_lens)
    rows = torch.full_like(out, float("nan"))
    ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, rows, nq, hd**-0.5, max_len,
                               seq_order=zeros)
    if layout["reads_order"]:
        assert torch.equal(rows[0], out[0]) and rows[1:].isnan().all()
    else:
        assert torch.equal(rows, out)


@pytest.mark.gpu
def test_graph_replay_with_new_lengths():
    """The grid comes from max_context_len, so a graph replays correctly for other lengths."""
    from nanograph import ops

    nq, nkv, hd, bs, max_len = 32, 8, 128, 16, 4096
    before, after = [4096, 1, 0, 700], [17, 4000, 33, 0]
    torch.manual_seed(0)
    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs(
        after, nq, nkv, hd, bs, max_len, full_tables=True)
    context_lens.copy_(torch.tensor(before, dtype=torch.int32))
    workspace = torch.zeros(ops.decode_attention_workspace_bytes(len(before), nq, hd, max_len) // 4,
                            device="cuda")

    def call():
        ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, nq,
                                   hd**-0.5, max_len, workspace)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    context_lens.copy_(torch.tensor(after, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q, k_cache, v_cache, block_tables, context_lens, nq)
    torch.testing.assert_close(out.float(), ref, **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nkv,max_len", [([383], 8, 400), ([1, 16, 17, 400], 8, 400), ([3000], 2, 16384),
                                              ([3070], 2, 16384), (random_lens(64, 1024, 6), 8, 1024),
                                              ([3001], 8, 4096)],
                         ids=["batch1", "batch4", "first_step", "second_step", "batch64", "interleaved"])
def test_newest_key_written_by_the_previous_kernel(lens, nkv, max_len):
    """Each sequence's newest key and value are written by the RoPE/KV-store kernel just before attention,
    into slots that held NaN, both replayed from one CUDA graph as in a decode step: attention must see them,
    though small grids load the older keys before waiting for that kernel. With 2 kv heads the newest key
    falls in a warp's first step (3000) or second (3070). Replayed ten times, as a stale read depends on
    timing."""
    from nanograph import ops

    from .test_rope_kv import cos_sin_table

    nq, hd, bs = 16, 128, 16
    torch.manual_seed(7)
    cos_sin = cos_sin_table(max_len, hd).cuda()
    qkv, k_cache, v_cache, block_tables, context_lens, out = make_inputs(lens, nq, nkv, hd, bs, max_len)
    qkv_before = qkv.clone()
    newest = context_lens.long() - 1
    slots = (block_tables.long().gather(1, (newest // bs)[:, None])[:, 0] * bs + newest % bs).to(torch.int32)
    positions = newest.to(torch.int32)
    workspace = torch.zeros(ops.decode_attention_workspace_bytes(len(lens), nq, hd, max_len) // 4, device="cuda")

    def step():
        ops.qk_norm_rope_kv_store(qkv, None, None, cos_sin, positions, slots, k_cache, v_cache, nq, nkv, 1e-6)
        ops.paged_decode_attention(qkv, k_cache, v_cache, block_tables, context_lens, out, nq, hd**-0.5,
                                   max_len, workspace)

    graph = captured(step)
    for _ in range(10):
        qkv.copy_(qkv_before)  # RoPE rotates q and k in place
        for cache in (k_cache, v_cache):
            cache.view(-1, nkv, hd)[slots.long()] = float("nan")
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not k_cache.view(-1, nkv, hd)[slots.long()].isnan().any(), "the newest keys were not stored"
        ref = reference(qkv, k_cache, v_cache, block_tables, context_lens, nq)
        torch.testing.assert_close(out.float(), ref, **TOL)


def plan(num_seqs, nq, nkv, hd, max_len):
    from nanograph import ops

    return ops.decode_attention_plan(num_seqs, nq, nkv, hd, max_len)


def bits(t):
    """A bf16 tensor's bit patterns: equal bits, NaN included."""
    return t.view(torch.int16)


# (id, context lengths, nq, nkv, head_dim, block_size, max_context_len, QK-norm). Small grids (at most 264 CTAs,
# which load keys before the PDL wait): batch 1 and 4 split, a group of 16 q heads at head_dim 64, and a newest key
# in a warp's second step, interleaved splits; large grids (longest first, as the engine runs them): a split batch of 64, an unsplit
# batch of 256, and a group of 16.
ROPE_CASES = [
    ("batch1_split", [383], 16, 8, 128, 16, 400, True),
    ("batch4_one_unstored", [1, 17, 200, 400], 16, 8, 128, 16, 400, True),
    ("batch64_split_hd64_no_norm", random_lens(64, 1024, 9, zeros=(3,)), 32, 8, 64, 16, 1024, False),
    ("batch256_unsplit", random_lens(256, 1024, 10, zeros=(7,)), 16, 8, 128, 16, 1024, True),
    ("group16_large_grid", [3000, 3070, 1, 0], 16, 1, 128, 16, 16384, True),
    ("hd64_group16_small_grid", [300, 0], 32, 2, 64, 16, 400, True),
    ("second_step_small_grid", [15990], 16, 2, 128, 16, 16384, True),
    ("interleaved_small_grid", [2999, 1], 16, 8, 128, 16, 4096, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,bs,max_len,qk_norm", [c[1:] for c in ROPE_CASES],
                         ids=[c[0] for c in ROPE_CASES])
def test_rotating_the_own_token_equals_the_rope_kernel_then_attention(lens, nq, nkv, hd, bs, max_len, qk_norm):
    """With cos_sin (a decode step's own token), attention normalises and rotates q and k and stores the newest
    key and value itself: the output and both caches must equal, bit for bit, those of the RoPE/KV-store kernel
    followed by attention on the rotated rows, and qkv must be left as it was. Replayed from a CUDA graph with
    the newest slots and the output poisoned before each replay, as a stale read depends on timing. A row whose
    slot is -1 stores nothing (both ways read what the cache held); a length-0 row gives zeros."""
    from nanograph import ops

    from .test_rope_kv import EPS, cos_sin_table

    torch.manual_seed(len(lens) + hd)
    qkv, k_cache, v_cache, block_tables, context_lens, out = make_inputs(lens, nq, nkv, hd, bs, max_len)
    qw, kw = [(torch.rand(hd, device="cuda") * 1.5 + 0.25).bfloat16() if qk_norm else None for _ in range(2)]
    cos_sin = cos_sin_table(max_len + 8, hd).cuda()
    newest = (context_lens.long() - 1).clamp(min=0)
    slots = (block_tables.long().gather(1, (newest // bs)[:, None])[:, 0] * bs + newest % bs).to(torch.int32)
    slots[context_lens == 0] = -1
    if len(lens) == 4 and lens[0] == 1:
        slots[2] = -1  # batch4_one_unstored
    positions = (newest + 3).to(torch.int32)  # any position: the rotation must follow positions, not lengths
    stored = slots[slots >= 0].long()

    def poison(kc, vc, o):
        for cache in (kc, vc):
            cache.view(-1, nkv, hd)[stored] = float("nan")
        o.fill_(float("nan"))

    # The separate kernels, on copies.
    qkv_rotated, kc_ref, vc_ref, out_ref = qkv.clone(), k_cache.clone(), v_cache.clone(), out.clone()
    poison(kc_ref, vc_ref, out_ref)
    ops.qk_norm_rope_kv_store(qkv_rotated, qw, kw, cos_sin, positions, slots, kc_ref, vc_ref, nq, nkv, EPS)
    ops.paged_decode_attention(qkv_rotated, kc_ref, vc_ref, block_tables, context_lens, out_ref, nq, hd**-0.5,
                               max_len)
    torch.cuda.synchronize()
    assert not kc_ref.view(-1, nkv, hd)[stored].isnan().any()
    torch.testing.assert_close(out_ref.float(), reference(qkv_rotated, kc_ref, vc_ref, block_tables, context_lens,
                                                          nq), **TOL)

    qkv_before = qkv.clone()
    order = None  # large grids take the sequences longest first, as in the engine's decode steps
    if plan(len(lens), nq, nkv, hd, max_len)["reads_order"]:
        order = torch.empty_like(context_lens)
        ops.order_by_length(context_lens, order)
    workspace = torch.zeros(max(ops.decode_attention_workspace_bytes(len(lens), nq, hd, max_len) // 4, 1),
                            device="cuda")

    def fused():
        ops.paged_decode_attention(qkv, k_cache, v_cache, block_tables, context_lens, out, nq, hd**-0.5, max_len,
                                   workspace, q_norm_weight=qw, k_norm_weight=kw, cos_sin=cos_sin,
                                   positions=positions, slot_mapping=slots, eps=EPS, seq_order=order)

    graph = captured(fused)
    for _ in range(5):
        poison(k_cache, v_cache, out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(out_ref)), "output differs from the separate kernels'"
        assert torch.equal(bits(k_cache), bits(kc_ref)), "k_cache differs from the RoPE/KV-store kernel's"
        assert torch.equal(bits(v_cache), bits(vc_ref)), "v_cache differs from the RoPE/KV-store kernel's"
        assert torch.equal(qkv, qkv_before), "qkv changed"
    assert (out[context_lens == 0] == 0).all()


# (id, context lengths, nq, nkv, head_dim, block_size, max_context_len, lengths replayed from the graph): small
# grids, whose sequences take one cluster of up to 8 CTAs per 2,048 keys. Where the GPU keeps all of the grid's
# clusters resident (the plan's cluster_merge; on an H200 up to 30 clusters of 8, so batch 1 takes 3 chunks of 8),
# sequences of one chunk merge in the cluster: 7 and 8 splits, keys all in split 0, a length-0 row, groups of 16 q
# heads (the merge's rows then need more than 48 KB of shared memory), and lengths far below max_context_len; longer
# ones merge through the workspace, in a cluster launch (several chunks at batch 1 and at 2 kv heads, and a replay
# that moves a sequence between one chunk and several) or without one (batch2_chunks: 16 rows of 2 chunks).
CLUSTER_CASES = [
    ("batch1_7_splits", [383], 16, 8, 128, 16, 400, [65]),
    ("batch1_keys_in_split_0", [40], 16, 8, 128, 16, 400, [400]),
    ("batch4_with_zero", [0, 17, 200, 400], 16, 8, 128, 16, 400, [399, 0, 1, 64]),
    ("hd64_8_splits", [100, 64, 0, 65], 32, 8, 64, 16, 512, [512, 511, 3, 0]),
    ("group16_hd64", [300, 0], 32, 2, 64, 16, 400, [0, 333]),
    ("group16_hd128_8_splits", [511], 16, 1, 128, 16, 512, [129]),
    ("all_empty", [0], 16, 8, 128, 16, 400, [0]),
    ("batch1_short_under_4096", [300], 16, 8, 128, 16, 4096, [2048]),
    ("batch4_4096", [2000, 0, 65, 129], 16, 8, 128, 16, 4096, [1, 2048, 513, 0]),
    ("hd64_8192_one_chunk", [2048, 3], 32, 8, 64, 16, 8192, [100, 1999]),
    ("group16_4096", [2000], 16, 1, 128, 16, 4096, [17]),
    ("batch1_chunks_32768", [32768], 16, 8, 128, 16, 32768, [128]),
    ("batch1_chunks_from_short", [128], 16, 8, 128, 16, 40960, [16000]),
    ("batch2_chunks", [6000, 100], 16, 8, 128, 16, 16384, [100, 16384]),
    ("kv2_many_chunks", [30000], 16, 2, 128, 16, 32768, [4097]),
    ("batch1_chunks_6144", [6000], 16, 8, 128, 16, 6144, [100]),
]


def workspace_regions(workspace, num_seqs, nq, nkv, hd, splits):
    """The binding's buffer: the arrival counters (zero at rest; 16-byte aligned), then the parts and their lse."""
    counters = num_seqs * nkv
    start = (counters + 3) // 4 * 4
    return workspace[start : start + num_seqs * nq * splits * (hd + 1)], workspace[:counters]


@pytest.mark.gpu
def test_cluster_cases_launch_clusters():
    """On sm_90 the cluster cases run cluster launches, both merges among them: a sequence of one chunk merging in
    its cluster, and one of several chunks (batch 1: 3 chunks of 8 CTAs) merging through the workspace from a
    cluster launch; and, on a GPU of 132 SMs, a grid whose clusters would not all be resident (batch2_chunks) runs
    without them."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread block clusters need sm_90")
    plans = {c[0]: plan(len(c[1]), c[2], c[3], c[4], c[6]) for c in CLUSTER_CASES}
    launched = {name for name, p in plans.items() if p["cluster_merge"]}
    assert {"batch1_7_splits", "group16_hd128_8_splits", "batch1_chunks_6144", "batch1_chunks_32768",
            "batch1_chunks_from_short"} <= launched, sorted(launched)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:  # an H200's or H100 SXM's residency
        assert "batch2_chunks" not in launched
        assert plans["batch1_chunks_6144"]["chunks"] == plans["batch1_chunks_32768"]["chunks"] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,bs,max_len,replay_lens", [c[1:] for c in CLUSTER_CASES],
                         ids=[c[0] for c in CLUSTER_CASES])
def test_cluster_merge_equals_the_workspace_merge(lens, nq, nkv, hd, bs, max_len, replay_lens):
    """Merged in a cluster (the default), the output equals bit for bit that of every split merging through the
    workspace (cluster_merge=False), eagerly and replayed from a CUDA graph with other lengths. On sm_90 the
    cluster leaves the parts in the workspace untouched when every sequence fills one chunk (where the plan launches
    clusters: all of them resident at once); either way each launch leaves the arrival counters at zero."""
    from nanograph import ops

    torch.manual_seed(sum(lens) + nq + hd)
    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs(lens, nq, nkv, hd, bs, max_len,
                                                                       full_tables=True)
    layout = plan(len(lens), nq, nkv, hd, max_len)
    assert layout["early_kv"] and layout["cluster"] > 1, "the case must be a small grid of clusters"
    words = ops.decode_attention_workspace_bytes(len(lens), nq, hd, max_len) // 4
    workspace = torch.zeros(words, device="cuda")
    parts, counters = workspace_regions(workspace, len(lens), nq, nkv, hd, layout["splits"])
    parts.fill_(float("nan"))

    def run(cluster_merge, into):
        into.fill_(float("nan"))
        ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, into, nq, hd**-0.5, max_len,
                                   workspace, cluster_merge=cluster_merge)

    def one_chunk_each():
        return all(n <= layout["chunk_min_keys"] for n in context_lens.tolist())

    run(True, out)
    torch.cuda.synchronize()
    assert (counters == 0).all(), "the cluster launch left an arrival counter set"
    if layout["cluster_merge"] and one_chunk_each():
        assert parts.isnan().all(), "the cluster merge wrote the workspace"
    expected = torch.empty_like(out)
    run(False, expected)
    torch.cuda.synchronize()
    assert (counters == 0).all(), "the workspace merge left an arrival counter set"
    cta_step = 64 if hd == 128 else 128  # the keys of one step of a CTA's 4 warps
    if any(n > cta_step for n in lens):
        assert not parts.isnan().all(), "the workspace merge left its parts unwritten"
    assert torch.equal(bits(out), bits(expected)), "the cluster merge differs from the workspace merge"
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, block_tables, context_lens, nq), **TOL)
    assert (out[context_lens == 0] == 0).all()

    graph = captured(lambda: run(True, out))
    context_lens.copy_(torch.tensor(replay_lens, dtype=torch.int32))
    for cache in (k_cache, v_cache):  # the new lengths reach keys that held NaN
        cache.copy_(torch.where(cache.isnan(), torch.randn_like(cache), cache))
    graph.replay()
    run(False, expected)
    torch.cuda.synchronize()
    assert (counters == 0).all()
    assert torch.equal(bits(out), bits(expected)), "the replayed cluster merge differs from the workspace merge"
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, block_tables, context_lens, nq), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nkv,bounds", [([100, 2000], 8, (2048, 40960)), ([5], 8, (512, 32768)),
                                             ([1500, 64, 0], 2, (2048, 16384))],
                         ids=["batch2", "batch1_tiny", "kv2_batch3"])
def test_the_work_follows_the_lengths_not_the_bound(lens, nkv, bounds):
    """Sequences that fill one chunk are divided the same way under a small bound and under the model's whole
    context: the same CTAs read the same keys, so the outputs are equal bit for bit."""
    from nanograph import ops

    nq, hd, bs = 16, 128, 16
    torch.manual_seed(sum(lens))
    q, k_cache, v_cache, block_tables, context_lens, _ = make_inputs(lens, nq, nkv, hd, bs, max(bounds),
                                                                     full_tables=True)
    outs = []
    for bound in bounds:
        layout = plan(len(lens), nq, nkv, hd, bound)
        assert layout["early_kv"] and all(n <= layout["chunk_min_keys"] for n in lens)
        out = torch.full((len(lens), nq * hd), float("nan"), device="cuda").bfloat16()
        ops.paged_decode_attention(q, k_cache, v_cache, block_tables[:, : math.ceil(bound / bs)].contiguous(),
                                   context_lens, out, nq, hd**-0.5, bound)
        outs.append(out)
    torch.cuda.synchronize()
    assert plan(len(lens), nq, nkv, hd, bounds[1])["splits"] > plan(len(lens), nq, nkv, hd, bounds[0])["splits"]
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    torch.testing.assert_close(outs[1].float(), reference(q, k_cache, v_cache, block_tables, context_lens, nq), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,nq,nkv,hd,max_len,bucket", [([3000, 17], 16, 8, 128, 32768, 4),
                                                          (random_lens(5, 4096, 11), 32, 8, 128, 4096, 8),
                                                          ([900], 16, 2, 64, 2048, 2)],
                         ids=["small_grid_bucket4", "large_grid_bucket8", "hd64_bucket2"])
def test_a_bucket_plan_serves_fewer_sequences(lens, nq, nkv, hd, max_len, bucket):
    """A launch of fewer sequences than its plan (a decode graph's bucket, run eagerly) is correct, and each
    sequence's output does not depend on the other rows of the launch. Launches of different batch sizes under
    one plan share its workspace, as the engine's steps do: each leaves the arrival counters at zero."""
    from nanograph import ops

    torch.manual_seed(len(lens) + bucket)
    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs(lens, nq, nkv, hd, 16, max_len)
    workspace = torch.zeros(ops.decode_attention_workspace_bytes(bucket, nq, hd, max_len) // 4, device="cuda")

    def call(rows, into):
        into.fill_(float("nan"))
        ops.paged_decode_attention(q[:rows], k_cache, v_cache, block_tables[:rows], context_lens[:rows], into, nq,
                                   hd**-0.5, max_len, workspace, plan_num_seqs=bucket)

    call(len(lens), out)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, block_tables, context_lens, nq), **TOL)
    alone, again = torch.empty_like(out[:1]), torch.empty_like(out)
    call(1, alone)
    call(len(lens), again)
    torch.cuda.synchronize()
    assert torch.equal(bits(alone), bits(out[:1]))
    assert torch.equal(bits(again), bits(out))
    with pytest.raises(ValueError, match="plan_num_seqs"):
        ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, nq, hd**-0.5, max_len,
                                   plan_num_seqs=len(lens) - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[176, 60, 145], [512, 1, 449, 0]], ids=["three", "four"])
def test_small_and_large_grid_plans_give_the_same_bits(lens):
    """Under a 512-token bound every plan cuts a sequence into the same 64-key parts, whatever the batch size it
    is planned for: a small grid (the RoPE/KV-store kernel, then attention; its parts merged in a cluster where the
    GPU keeps all of its clusters resident) and a
    large one (RoPE inside attention, the sequences longest first; its parts merged through the workspace) give
    the same bits, so a request's tokens do not depend on the batch it decodes in."""
    from nanograph import ops

    from .test_rope_kv import EPS, cos_sin_table

    nq, nkv, hd, bs, max_len = 16, 8, 128, 16, 512
    small, large = plan(len(lens), nq, nkv, hd, max_len), plan(16, nq, nkv, hd, max_len)
    assert small["early_kv"] and not large["early_kv"]
    torch.manual_seed(sum(lens))
    qkv, k_cache, v_cache, block_tables, context_lens, out = make_inputs(lens, nq, nkv, hd, bs, max_len)
    qw, kw = [(torch.rand(hd, device="cuda") * 1.5 + 0.25).bfloat16() for _ in range(2)]
    cos_sin = cos_sin_table(max_len + 8, hd).cuda()
    newest = (context_lens.long() - 1).clamp(min=0)
    slots = (block_tables.long().gather(1, (newest // bs)[:, None])[:, 0] * bs + newest % bs).to(torch.int32)
    slots[context_lens == 0] = -1
    positions = newest.to(torch.int32)

    qkv_rotated, kc_small, vc_small, out_small = qkv.clone(), k_cache.clone(), v_cache.clone(), out.clone()
    ops.qk_norm_rope_kv_store(qkv_rotated, qw, kw, cos_sin, positions, slots, kc_small, vc_small, nq, nkv, EPS)
    ops.paged_decode_attention(qkv_rotated, kc_small, vc_small, block_tables, context_lens, out_small, nq,
                               hd**-0.5, max_len)
    order = torch.empty_like(context_lens)
    ops.order_by_length(context_lens, order)
    ops.paged_decode_attention(qkv, k_cache, v_cache, block_tables, context_lens, out, nq, hd**-0.5, max_len,
                               q_norm_weight=qw, k_norm_weight=kw, cos_sin=cos_sin, positions=positions,
                               slot_mapping=slots, eps=EPS, seq_order=order, plan_num_seqs=16)
    torch.cuda.synchronize()
    assert torch.equal(bits(k_cache), bits(kc_small)) and torch.equal(bits(v_cache), bits(vc_small))
    assert torch.equal(bits(out), bits(out_small)), "the large grid's bits differ from the small grid's"


@pytest.mark.gpu
def test_rejects_bad_arguments():
    from nanograph import ops

    nq, nkv, hd, bs, max_len = 8, 2, 128, 16, 1024  # long enough to need a split workspace
    q, k_cache, v_cache, block_tables, context_lens, out = make_inputs([5, 900], nq, nkv, hd, bs, max_len)

    def call(**overrides):
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                    context_lens=context_lens, out=out, num_q_heads=nq, scale=0.1,
                    max_context_len=max_len)
        args.update(overrides)
        ops.paged_decode_attention(**args)

    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        call(num_q_heads=7)
    with pytest.raises(ValueError, match="up to 16 q heads"):
        call(num_q_heads=64, q=torch.zeros(2, 64 * hd, device="cuda").bfloat16(),
             out=torch.zeros(2, 64 * hd, device="cuda").bfloat16())
    with pytest.raises(ValueError, match="block_size"):
        call(k_cache=k_cache.view(-1, 8, nkv, hd), v_cache=v_cache.view(-1, 8, nkv, hd))
    with pytest.raises(ValueError, match="head_dim 96"):
        call(k_cache=k_cache[..., :96].contiguous(), v_cache=v_cache[..., :96].contiguous())
    with pytest.raises(ValueError, match="cannot hold max_context_len"):
        call(max_context_len=max_len + 1)
    with pytest.raises(ValueError, match="out"):
        call(out=out[:, :hd].contiguous())
    with pytest.raises(TypeError, match="context_lens"):
        call(context_lens=context_lens.long())
    with pytest.raises(ValueError, match="workspace"):
        call(workspace=torch.empty(1, device="cuda"))
    positions = torch.zeros(2, dtype=torch.int32, device="cuda")
    cos_sin = torch.randn(max_len, hd, device="cuda")
    with pytest.raises(ValueError, match="positions and slot_mapping"):
        call(cos_sin=cos_sin, positions=positions)
    with pytest.raises(ValueError, match="go with cos_sin"):
        call(positions=positions)
    with pytest.raises(ValueError, match="both"):
        call(cos_sin=cos_sin, positions=positions, slot_mapping=positions,
             q_norm_weight=torch.ones(hd, device="cuda").bfloat16())
    misaligned = torch.randn(max_len * hd + 4, device="cuda")[1 : 1 + max_len * hd].view(max_len, hd)
    with pytest.raises(ValueError, match="16-byte boundary"):
        call(q=torch.zeros(2, (nq + 2 * nkv) * hd, device="cuda").bfloat16(), cos_sin=misaligned,
             positions=positions, slot_mapping=positions)
    with pytest.raises(ValueError, match="positions and slot_mapping"):  # an empty table still asks for rope
        call(cos_sin=cos_sin[:0], positions=positions)
    with pytest.raises(ValueError, match="q must have shape"):  # raw qkv rows: (nq + 2 nkv) * hd
        call(q=q[:, : nq * hd].contiguous(), cos_sin=cos_sin, positions=positions, slot_mapping=positions)


def test_reference_matches_sdpa():
    """The reference agrees with torch's attention on a contiguous (unpaged) cache."""
    torch.manual_seed(0)
    nq, nkv, hd, bs, lens = 8, 2, 64, 4, [7, 12]
    k_cache = torch.randn(8, bs, nkv, hd).bfloat16()
    v_cache = torch.randn(8, bs, nkv, hd).bfloat16()
    block_tables = torch.tensor([[5, 0, -1], [3, 7, 1]], dtype=torch.int32)
    q = torch.randn(2, nq * hd).bfloat16()
    ref = reference(q, k_cache, v_cache, block_tables, torch.tensor(lens), nq)
    for s, length in enumerate(lens):
        k = k_cache[block_tables[s, : math.ceil(length / bs)].long()].reshape(-1, nkv, hd)[:length]
        v = v_cache[block_tables[s, : math.ceil(length / bs)].long()].reshape(-1, nkv, hd)[:length]
        k = k.float().repeat_interleave(nq // nkv, dim=1).transpose(0, 1)  # [nq, L, hd]
        v = v.float().repeat_interleave(nq // nkv, dim=1).transpose(0, 1)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[s].float().view(nq, 1, hd), k, v).reshape(-1)
        torch.testing.assert_close(ref[s], expected, atol=1e-5, rtol=1e-5)
