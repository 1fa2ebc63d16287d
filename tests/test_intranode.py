"""Intranode kernels (peers mapped through the virtual-memory API or CUDA IPC) against the portable
backend, bit for bit, with ranks sharing one GPU.

Every test runs the same rank function on GPU ranks (kernels) and CPU ranks (portable backend) and
compares all outputs. Skipped where there is no GPU or no extension.
"""
import pytest
import torch

from moe_ep import Config, _native
from moe_ep.launch import ranks_share_a_gpu
from moe_ep.backends.peers import KernelEnums

from . import rank_fns
from .problems import Problem, make_inputs, ref_dispatch
from .problems import same_bits as _same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason())),
]

# Peers that never come are named after this long.
SHORT_TIMEOUT = {"MOE_EP_TIMEOUT_S": "2.0"}
FIELDS = rank_fns.ROUND_FIELDS


def _compare(seed, on_gpu, on_cpu, against="the portable backend"):
    for rank, (g, c) in enumerate(zip(on_gpu, on_cpu)):
        for field in FIELDS:
            assert _same(g[field], c[field]), f"seed {seed} rank {rank}: {field} differs from {against}"


def _both(pools, gpu_pools, num_ranks, fn, *args, **kwargs):
    return gpu_pools(num_ranks).run(fn, *args, **kwargs), pools(num_ranks).run(fn, *args, **kwargs)


# The Buffer's default arena (its own, grown where a dispatch finds no room), and none (two passes).
ARENAS = pytest.mark.parametrize("arena", [None, False], ids=["default_arena", "two_pass"])


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("variant", list(rank_fns.ROUND_VARIANTS.values()), ids=list(rank_fns.ROUND_VARIANTS))
@ARENAS
def test_intranode_equals_portable(pools, gpu_pools, seed, num_ranks, variant, arena):
    p = Problem(seed, num_ranks, num_ranks * 8, 512, 6, max_tokens=96)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.normal_round, p, arena=arena, **variant)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.normal_round, p, **variant))


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("variant", [
    dict(combine_x="empty_combine_input"),
    dict(combine_x="tensor", num_biases=1),
    dict(combine_x="empty_combine_input", use_fp8=True, num_biases=2),
    dict(combine_x="tensor", use_fp8=True, num_worst_tokens=768),  # 8 ranks x 96 tokens: any load fits
    dict(combine_x="empty_combine_input", num_worst_tokens=768, with_topk=False),
])
def test_arena_rounds_equal_two_pass_rounds(gpu_pools, seed, num_ranks, variant):
    """With an arena with room every dispatch (fresh, cached, num_worst_tokens; bf16 and fp8) stores its
    rows once into it and every combine reads them from the arenas, an x from empty_combine_input where
    it lies, an ordinary x after its copy (where that pays: from 4 ranks up): the same kernels' two-pass
    round on a Buffer without an arena, bit for bit."""
    p = Problem(seed, num_ranks, num_ranks * 8, 512, 6, max_tokens=96)
    pool = gpu_pools(num_ranks)
    with_arena = pool.run(rank_fns.normal_round, p, arena=True, **variant)
    _compare(seed, with_arena, pool.run(rank_fns.normal_round, p, arena=False, **variant),
             against="the two-pass round")


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
@pytest.mark.parametrize("variant", [
    dict(combine_x="empty_combine_input", num_biases=1),
    dict(combine_x="recv_x", stream_args=True),
    dict(combine_x="tensor", use_fp8=True, num_biases=2),
    dict(combine_x="empty_combine_input", num_worst_tokens=768, with_topk=False),
    dict(combine_x="tensor", dtype=torch.float32, stream_args=True),
])
def test_combines_from_the_arena_equal_portable(pools, gpu_pools, seed, num_ranks, variant):
    """With an arena every plain combine reads the rows from the ranks' arenas, wherever x lies there (a
    tensor from empty_combine_input, a recv_x written over) or after copying it there."""
    p = Problem(seed, num_ranks, num_ranks * 8, 512, 6, max_tokens=96)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.normal_round, p, arena=True, **variant)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.normal_round, p, **variant))


@pytest.mark.parametrize("num_ranks", [4, 8])
@pytest.mark.parametrize("arena", [None, False, True], ids=["default_arena", "two_pass", "arena"])
def test_calls_beside_compute_kernels_equal_portable(pools, gpu_pools, seed, num_ranks, arena):
    """Every call async, with matmuls on the current stream while its kernels run (ranks sharing the GPU
    run theirs too): what a training step does. The ranks' kernels wait on each other while other
    kernels hold SMs (a megatron run at EP=4 on one H200, where they do, timed out)."""
    p = Problem(seed, num_ranks, num_ranks * 8, 1024, 6, max_tokens=512)
    variant = dict(stream_args=True, busy=True, num_biases=1)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.normal_round, p, arena=arena, **variant)
    _compare(seed, on_gpu, pools(num_ranks).run(rank_fns.normal_round, p, **variant))


@pytest.mark.parametrize("num_ranks", [4, 8])
@pytest.mark.parametrize("arena", [None, False, True], ids=["default_arena", "two_pass", "arena"])
def test_buffers_made_while_another_buffers_calls_run(pools, gpu_pools, seed, num_ranks, arena):
    """Several Buffers over one group, each made right after the previous one's async calls were issued,
    with matmuls beside them (megatron's dispatcher once made one per layer so, and its training at EP=4
    on one H200 timed out: DESIGN.md, "megatron-core integration")."""
    p = Problem(seed, num_ranks, num_ranks * 8, 1024, 6, max_tokens=256)
    on_gpu, on_cpu = _both(pools, gpu_pools, num_ranks, rank_fns.buffers_made_while_calls_run, p, arena=arena)
    for rank, (g, c) in enumerate(zip(on_gpu, on_cpu)):
        for layer, (got, expected) in enumerate(zip(g, c)):
            assert _same(got, expected), f"seed {seed} rank {rank}: Buffer {layer}'s recv_x/combined differ"


@pytest.mark.parametrize("num_worst_tokens,arena", [(0, False), (256, False), (0, True), (0, None)])
def test_async_calls_keep_their_inputs(pools, gpu_pools, seed, num_worst_tokens, arena):
    """Inputs the caller drops right after an async call, their memory rewritten at once on its stream
    while the call still waits behind an earlier kernel: the results are the inputs' (with
    num_worst_tokens nothing waits on the host, so the count exchange's inputs too are read late)."""
    p = Problem(seed, 4, 32, 1024, 6, max_tokens=64)
    on_gpu, on_cpu = _both(pools, gpu_pools, 4, rank_fns.inputs_dropped_after_async_calls, p, num_worst_tokens,
                           arena=arena)
    for rank, (got, expected) in enumerate(zip(on_gpu, on_cpu)):
        assert _same(got, expected), f"seed {seed} rank {rank}: an async call read an input the caller had dropped"


@pytest.mark.parametrize("num_ranks,hidden,dtype", [(3, 132, torch.bfloat16), (2, 256, torch.float32),
                                                    (5, 2052, torch.bfloat16), (4, 2052, torch.bfloat16),
                                                    (5, 2048, torch.bfloat16), (4, 120, torch.bfloat16)])
def test_odd_rank_counts_and_row_sizes(pools, gpu_pools, seed, num_ranks, hidden, dtype):
    """Rank counts outside 2/4/8 and rows that are a multiple of 8 bytes but not of 16; from 4 ranks
    (the streaming combine) rows of fewer vectors than a warp has lanes, or not a whole number of a
    warp's trips (its lanes once left the trips unevenly and hung in a shuffle)."""
    p = Problem(seed, num_ranks, num_ranks * 4, hidden, 3, max_tokens=40)
    kwargs = dict(num_biases=2, dtype=dtype)
    _compare(seed, gpu_pools(num_ranks).run(rank_fns.normal_round, p, arena=False, **kwargs),
             pools(num_ranks).run(rank_fns.normal_round, p, **kwargs))


@pytest.mark.parametrize("num_ranks,hidden,dtype,small_buffer,num_biases", [
    (2, 7168, torch.bfloat16, False, 2), (4, 2048, torch.bfloat16, False, 0), (8, 7168, torch.bfloat16, False, 1),
    (3, 132, torch.bfloat16, True, 2), (4, 256, torch.float32, True, 1), (5, 512, torch.bfloat16, True, 0),
    (8, 512, torch.bfloat16, True, 1),
])
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "windowed"])
def test_both_combines_give_the_same_bits(pools, gpu_pools, seed, num_ranks, hidden, dtype, small_buffer, num_biases,
                                          stream):
    """Either combine, whatever the rank count picks by default (stream_combine forces it): the
    same bits, with rings or windows of a few rows in a small buffer (batches of fewer tokens than
    warps; from 8 ranks the streaming receive goes per warp, its releases a row or two apart), odd
    rank counts, 8-byte rows and float32 rows."""
    config = Config(4, 2, 4, 2, 4) if small_buffer else None
    p = Problem(seed, num_ranks, num_ranks * 8, hidden, 6, max_tokens=96)
    kwargs = dict(num_biases=num_biases, config=config, dtype=dtype)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.forced_combine_round, p, stream, **kwargs)
    assert all((rows > 0) == stream for _, rows in on_gpu), "the combine did not take the forced path"
    _compare(seed, [result for result, _ in on_gpu], pools(num_ranks).run(rank_fns.normal_round, p, **kwargs))


@pytest.mark.parametrize("num_ranks,send_tokens", [(4, 1), (4, 255), (8, 3), (5, 2)])
def test_stream_combine_send_chunk(pools, gpu_pools, seed, num_ranks, send_tokens):
    """The streaming combine's sending rounds capped at Config's num_max_nvl_chunked_send_tokens rows per
    owner (1: a release per row; 255: more than a channel has here, as uncapped): the same bits."""
    config = Config(24, send_tokens, 256, 6, 128)
    p = Problem(seed, num_ranks, num_ranks * 8, 2048, 6, max_tokens=96)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.forced_combine_round, p, True, config=config, num_biases=1)
    assert all(rows > 0 for _, rows in on_gpu), "the streaming combine did not run"
    _compare(seed, [result for result, _ in on_gpu],
             pools(num_ranks).run(rank_fns.normal_round, p, config=config, num_biases=1))


@pytest.mark.parametrize("num_ranks,num_sms", [(8, 24), (6, 24), (4, 20), (2, 24)])
def test_blocks_fitted_to_ranks_sharing_a_gpu(pools, gpu_pools, seed, num_ranks, num_sms):
    """Where ranks share a GPU the kernels may run on fewer blocks than the SM budget (the count whose
    shape keeps the most loads in flight, the combines' 1024-thread blocks first): never more
    than the budget, the same counts on every rank, and the portable backend's bits with and without
    fitting (streaming combine from 4 ranks up, windowed below, a round through the arena too)."""
    p = Problem(seed, num_ranks, num_ranks * 8, 2048, 6, max_tokens=96)
    on_cpu = pools(num_ranks).run(rank_fns.normal_round, p)
    for fit in (True, False):
        on_gpu = gpu_pools(num_ranks).run(rank_fns.fitted_blocks_round, p, fit, num_sms)
        blocks = {b for _, b in on_gpu}
        assert len(blocks) == 1, f"fit={fit}: ranks ran on different block counts {blocks}"
        counts = blocks.pop()
        if fit:
            assert all(1 <= count <= num_sms for count in counts), f"fitted {counts} blocks for a budget of {num_sms}"
        else:
            assert counts == (num_sms, num_sms), f"fit_blocks=False ran {counts} blocks for a budget of {num_sms}"
        _compare(seed, [result for result, _ in on_gpu], on_cpu)
        for rank, (result, _) in enumerate(on_gpu):
            assert torch.equal(result["arena"], on_cpu[rank]["combined"]), f"rank {rank}: the round through the arena"


@pytest.mark.parametrize("num_ranks,hidden,cached", [(2, 7168, False), (3, 2052, True), (4, 512, False),
                                                     (8, 1024, True)])
def test_repeated_combines_from_the_arena_give_the_two_pass_bits(gpu_pools, seed, num_ranks, hidden, cached):
    """Three combines in a row, each of rows written into empty_combine_input (summed where they lie by
    the ranks that own the tokens) and of the same rows from a tensor of their own (copied into the
    arena): the bits of the two-pass combine on a Buffer without an arena, also after a cached dispatch
    and with rows of 8-byte vectors (which the two-pass kernels take)."""
    p = Problem(seed, num_ranks, num_ranks * 8, hidden, 6, max_tokens=64)
    for rank, results in enumerate(gpu_pools(num_ranks).run(rank_fns.arena_combine_rounds, p, 2, 3, cached)):
        for i, (in_place, in_place_w, copied, copied_w, two_pass, two_pass_w) in enumerate(results):
            assert torch.equal(in_place, two_pass) and torch.equal(copied, two_pass), f"rank {rank}, combine {i}: rows"
            assert torch.equal(in_place_w, two_pass_w) and torch.equal(copied_w, two_pass_w), \
                f"rank {rank}, combine {i}: weights"


@pytest.mark.parametrize("num_ranks,hidden,variant", [
    (2, 512, dict(use_fp8=True, num_biases=1)),
    (3, 132, dict()),  # rows of 264 bytes: not 16-byte vectors
    (4, 512, dict(with_topk=False, stream_args=True)),
    (5, 2052, dict(num_worst_tokens=480)),  # 5 ranks x 96 tokens: any load fits
    (8, 2048, dict(use_fp8=True, num_worst_tokens=768)),
])
def test_arena_rounds_of_any_row_size_equal_portable(pools, gpu_pools, seed, num_ranks, hidden, variant):
    """Both dispatches of a round into the arena (rows stored straight at their place in the receivers'
    regions): the portable backend's bits, the first recv_x read after the cached dispatch took a region
    of its own, for odd rank counts and rows of any size."""
    p = Problem(seed, num_ranks, num_ranks * 8, hidden, 6, max_tokens=96)
    _compare(seed, *_both(pools, gpu_pools, num_ranks, rank_fns.normal_round, p, arena=True, **variant))


@pytest.mark.parametrize("num_ranks,arena", [(2, False), (8, True)])
def test_buffers_mapped_through_cuda_ipc(pools, gpu_pools, seed, num_ranks, arena):
    """peer_memory="ipc": the peers' buffers and arenas opened from CUDA IPC handles instead of file
    descriptors (the default where the GPU can export them): the same bits."""
    p = Problem(seed, num_ranks, num_ranks * 8, 512, 6, max_tokens=96)
    args = (rank_fns.normal_round, p)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.with_choices, dict(peer_memory="ipc"), *args, arena=arena,
                                      use_fp8=True)
    _compare(seed, on_gpu, pools(num_ranks).run(*args, arena=arena, use_fp8=True))


@pytest.mark.parametrize("num_ranks,use_fp8,num_worst_tokens", [(2, True, 0), (4, False, 256), (8, False, 0), (3, True, 0)])
def test_dispatches_into_the_arena_equal_the_two_pass_ones(gpu_pools, seed, num_ranks, use_fp8, num_worst_tokens):
    """Fresh, num_worst_tokens and cached dispatches store their rows once, into regions that recv_x
    owns: the two-pass dispatch's bits, each recv_x intact after six more dispatches, and every region
    back in the arena once the outputs are gone."""
    p = Problem(seed, num_ranks, num_ranks * 4, 1024, 4, max_tokens=64)
    per_rank = gpu_pools(num_ranks).run(rank_fns.dispatches_into_arena, p, use_fp8, num_worst_tokens)
    for rank, (results, whole) in enumerate(per_rank):
        for i, (into_arena, two_pass, intact) in enumerate(results):
            assert _same(into_arena, two_pass), f"seed {seed} rank {rank}, dispatch {i}"
            assert intact, f"seed {seed} rank {rank}, dispatch {i}: its recv_x changed with later dispatches"
        assert whole, f"seed {seed} rank {rank}: regions not returned to the arena"


def test_a_recv_x_from_the_arena_outlives_its_buffer(gpu_pools, seed):
    """destroy() with an arena's recv_x alive: the tensor keeps its memory (and its rows) until it dies."""
    p = Problem(seed, 2, 8, 512, 2, max_tokens=32)
    outcomes = gpu_pools(2).run(rank_fns.arena_tensor_outlives_its_buffer, p)
    assert all(outcomes), f"seed {seed}: {outcomes}"


def test_rows_an_arena_cannot_hold_take_two_passes(gpu_pools, seed):
    """A fixed arena too small for some ranks' rows (every rank's, with num_worst_tokens past it): the
    ranks agree on the two-pass path, so each call gives the two-pass results, and a dispatch that fits
    every rank afterwards takes one pass with the same results."""
    outcomes = gpu_pools(3).run(rank_fns.arena_too_small, Problem(seed, 3, 12, 128, 3, max_tokens=24), 5)
    for rank, (same, received) in enumerate(outcomes):
        assert same == [True, True, True], \
            f"seed {seed} rank {rank} ({received} rows): {same} (short of room, num_worst_tokens, fits)"


def _first_rows(value, n):
    return tuple(_first_rows(v, n) for v in value) if isinstance(value, tuple) else value[:n]


@pytest.mark.parametrize("use_fp8", [False, True])
def test_rows_past_num_worst_tokens_are_dropped_and_reported(pools, gpu_pools, seed, use_fp8):
    """num_worst_tokens below what the ranks receive: the rows that fit are the right ones (a kernel that
    copies rows in pairs may find a pair straddling the end), the next call on such a rank raises a
    ValueError naming num_worst_tokens, and the dispatch after it equals the portable backend's."""
    p = Problem(seed, 3, 24, 512, 6, max_tokens=96)
    inputs = make_inputs(p)
    most = max(len(ref_dispatch(p, inputs, rank)[0]) for rank in range(p.num_ranks))
    # Below what the busiest rank receives whatever the seed: 37 alone left one seed in eleven without
    # an overflow on any rank.
    worst = max(1, min(37, most - 1))
    on_gpu = gpu_pools(3).run(rank_fns.worst_tokens_overflow, p, worst, use_fp8)
    on_cpu = pools(3).run(rank_fns.worst_tokens_overflow, p, worst, use_fp8)
    for rank, (g, c) in enumerate(zip(on_gpu, on_cpu)):
        short, full = g["results"]
        for key in ("x", "idx", "w"):
            assert _same(full[key], c["results"][-1][key]), f"seed {seed} rank {rank}: {key} differs from portable"
        received = full["idx"].shape[0]
        if received > worst:
            assert g["outcomes"][0] == "no exception" and "num_worst_tokens" in g["outcomes"][1], g["outcomes"]
        else:
            assert g["outcomes"] == ["no exception", "no exception"], g["outcomes"]
        kept = min(received, worst)
        for key in ("x", "idx", "w"):
            assert _same(_first_rows(short[key], kept), _first_rows(full[key], kept)), \
                f"seed {seed} rank {rank}: the first {kept} rows' {key} differ from an ordinary dispatch's"


@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_many_windows_in_a_small_buffer(pools, gpu_pools, seed, num_ranks, use_fp8):
    """A buffer sized for a tiny config holds a few tokens per window: dispatch and combine go through
    many windows (and both halves) per call."""
    config = Config(4, 2, 4, 2, 4)
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=200)
    kwargs = dict(use_fp8=use_fp8, num_biases=1, config=config)
    _compare(seed, gpu_pools(num_ranks).run(rank_fns.normal_round, p, arena=False, **kwargs),
             pools(num_ranks).run(rank_fns.normal_round, p, **kwargs))


def test_wait_profile_adds_up(pools, gpu_pools, seed):
    """The wait profile (profile_waits): results unchanged; every block's waits inside the kernel fit in its time, and
    so do its phases (which include those waits), both of which take time."""
    p = Problem(seed, 4, 16, 256, 4, max_tokens=64)
    got = gpu_pools(4).run(rank_fns.profiled_round, p)
    _compare(seed, [result for result, _, _ in got], pools(4).run(rank_fns.normal_round, p))
    for rank, (_, profile, _) in enumerate(got):
        for kernel in ("dispatch", "combine"):
            times = profile[kernel]
            assert times["kernel"] > 0 and times["blocks"] > 0, f"rank {rank} {kernel}: {times}"
            # The count exchange's wait happens in the notify kernel, outside the dispatch kernel's time.
            waited = sum(v for what, v in times.items() if what not in ("kernel", "blocks", "phases", "token counts"))
            assert waited <= times["kernel"], f"rank {rank} {kernel}: {times}"
            phases = times["phases"]
            assert set(phases) == ({"stage", "pull"} if kernel == "dispatch" else {"push", "reduce"}), phases
            assert waited <= sum(phases.values()) <= times["kernel"], f"rank {rank} {kernel}: {times}"


def test_kernel_log_lists_each_calls_kernels_in_order(gpu_pools, seed):
    """With profile_waits every intranode kernel of a rank is logged once, in the order it ran (one
    stream: each starts after the one before ended), a fresh dispatch as its count exchange and data
    kernel, a combine behind a rendezvous where ranks share a GPU."""
    p = Problem(seed, 4, 16, 256, 4, max_tokens=64)
    kernel = KernelEnums(_native.ops()).kernel_id
    for rank, (_, _, log) in enumerate(gpu_pools(4).run(rank_fns.profiled_round, p)):
        kinds = [kernel.name_of(kind) for kind, _, _ in log]
        assert kinds and all(start <= end for _, start, end in log), f"rank {rank}: {log}"
        assert all(a[2] <= b[1] for a, b in zip(log, log[1:])), f"rank {rank}: kernels overlap: {log}"
        assert kinds[:2] == ["NOTIFY", "DISPATCH"], \
            f"rank {rank}: a fresh dispatch is its count exchange then its kernel: {kinds}"
        combines = [i for i, kind in enumerate(kinds) if kind in ("COMBINE", "STREAM_COMBINE")]
        assert combines, f"rank {rank}: no combine logged: {kinds}"
        if ranks_share_a_gpu(4):
            assert all(kinds[i - 1] == "RENDEZVOUS" for i in combines), \
                f"rank {rank}: a combine without its rendezvous: {kinds}"


def test_large_problem(pools, gpu_pools, seed):
    p = Problem(seed, 4, 64, 2048, 8, max_tokens=1024, drop=0.05)
    _compare(seed, *_both(pools, gpu_pools, 4, rank_fns.normal_round, p, use_fp8=True, num_biases=1))


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_twenty_repeats_give_identical_bits(pools, gpu_pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 8, 1024, 8, max_tokens=256)
    digests = gpu_pools(num_ranks).run(rank_fns.repeated_rounds, p, 20, True)
    reference = pools(num_ranks).run(rank_fns.repeated_rounds, p, 1, True)
    for rank, (got, want) in enumerate(zip(digests, reference)):
        assert set(got) == {want[0]}, f"seed {seed} rank {rank}: {len(set(got))} distinct results in 20 repeats"


@pytest.mark.parametrize("num_ranks,arena", [(2, False), (4, False), (3, True)])
def test_cuda_graph_capture_and_replay(gpu_pools, seed, num_ranks, arena):
    """num_worst_tokens: no host synchronisation, so layout, dispatch and combine capture in one graph;
    replays on new data equal eager calls on that data (also under an arena, which the captured calls
    leave for the two-pass path while the eager ones take it)."""
    # Same seed, so the same token counts (the graph's shapes are fixed) and rows; other -1 entries.
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=64, drop=0.2)
    q = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=64, drop=0.5)
    results = gpu_pools(num_ranks).run(rank_fns.graph_round, p, q, num_ranks * 64, arena)
    for rank, (replays, eager_q, eager_p) in enumerate(results):
        for i, want in enumerate((eager_q, eager_p, eager_q)):
            assert _same(replays[i], want), f"seed {seed} rank {rank}: replay {i} differs from the eager call"


def test_a_peer_missing_at_the_first_dispatch_is_named(gpu_pools):
    results = gpu_pools(2).run(rank_fns.with_env, SHORT_TIMEOUT, rank_fns.skip_a_call, 1, "dispatch")
    assert results[1] == "skipped"
    kind, message = results[0]
    assert kind == "TimeoutError" and "rank(s) 1 did not arrive" in message, message


@pytest.mark.parametrize("phase,waited_for,stream,num_ranks", [
    ("dispatch", "its token counts", False, 3), ("combine", "combine rows", False, 3),
    ("combine", "combine rows", True, 3), ("combine", "combine rows", True, 8),
])
def test_a_peer_missing_in_a_kernel_is_named(gpu_pools, phase, waited_for, stream, num_ranks):
    """The kernels' waits have a deadline: they report the rank they waited for and return; no hang
    (either combine: stream = stream_combine; at 8 ranks the streaming receive goes per warp)."""
    missing = num_ranks - 1
    results = gpu_pools(num_ranks).run(rank_fns.with_env, SHORT_TIMEOUT, rank_fns.with_choices,
                                       dict(stream_combine=stream), rank_fns.skip_after_warmup, missing, phase)
    skipped, report = results[missing]
    # Where the skipping rank stood: its warm-up dispatch launched, done on the device, the stream idle.
    assert skipped == "skipped" and report.startswith(f"rank {missing}: calls launched by the host, oldest "
                                                      "first: dispatch "), report
    assert "last to finish: the dispatch of call" in report and report.endswith("communication stream idle"), report
    for rank, outcome in enumerate(results[:missing]):
        assert isinstance(outcome, tuple), f"rank {rank}: {outcome} without rank {missing}"
        kind, message = outcome
        # Ranks sharing a GPU start a combine together (a rendezvous kernel first): that is where they wait.
        expected = "to reach this call's" if phase == "combine" and ranks_share_a_gpu(num_ranks) else waited_for
        assert kind == "TimeoutError" and f"rank {missing} did not arrive" in message and expected in message, message
        # Its progress mark: the skipped call's kernel never started there.
        assert "had not started this call's kernel" in message, message


def test_an_sm_budget_that_cannot_be_resident_is_refused(gpu_pools):
    p = Problem(4, 8, 32, 128, 2, max_tokens=8)
    for rank, (outcome, rows) in enumerate(gpu_pools(8).run(rank_fns.oversized_sm_budget, p, 400)):
        assert outcome.startswith("num_sms (Config)") and "use num_sms <=" in outcome, outcome
        assert rows >= 0, f"rank {rank}: the Buffer must work after the refusal"


def test_a_kernel_handle_with_cpu_tensors_is_refused(gpu_pools):
    p = Problem(3, 2, 8, 128, 2, max_tokens=8)
    for message in gpu_pools(2).run(rank_fns.handle_on_the_wrong_device, p):
        assert message.startswith("handle:") and "CUDA" in message, message


def test_python_and_cuda_layouts_agree(gpu_pools):
    cases = [(2, 1 << 20, 14336, 224, 8), (8, 367431680, 7168, 224, 8), (3, 5_000_000, 264, 0, 3),
             (64, 1 << 30, 8192, 256, 32), (4, 1000, 256, 0, 1), (2, 1 << 20, 0, 0, 0)]
    for cuda_numbers, python_numbers in gpu_pools(2).run(rank_fns.intranode_layout_numbers, cases)[0]:
        for key, value in python_numbers.items():
            assert cuda_numbers[key] == value, key
