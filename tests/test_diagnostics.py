"""Buffer.check_errors, stats, reset_stats and topology (moe_ep.diagnostics): what they report on CPU
ranks (the portable backend), on the arena's own bookkeeping, and on GPU ranks (the kernels: one-pass
counts, arena bytes, peer paths, errors the kernels reported)."""
import types

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Buffer, _native
from moe_ep.arena import Arena
from moe_ep.diagnostics import CALL_KINDS, Traffic, call_counts, kernel_backend, stats as diagnostics_stats

from . import rank_fns
from .problems import Problem, expert_output, make_inputs, ref_dispatch
from .rank_fns import TWO_PASS, arena_area, dispatch_args, low_latency_buffer, my_inputs, normal_buffer

# The GPU tests need a CUDA device and the built extension.
kernels_only = pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason()))


# ---------------------------------------------------------------------------- rank functions
def counted_calls(p: Problem, cached: int, low_latency: int) -> dict:
    """A layout, a dispatch, `cached` cached dispatches, a combine, a refused dispatch, `low_latency`
    low-latency rounds and an internode_dispatch: stats() after them, after reset_stats(), and after
    one more combine."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden)
    args = dispatch_args(buffer, inp, p)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **args)
    for _ in range(cached):
        buffer.dispatch(inp["x"], handle=handle)
    y = expert_output(recv_x, dist.get_rank())
    buffer.combine(y, handle, topk_weights=recv_w)
    try:  # refused before any backend runs: not counted
        buffer.dispatch(inp["x"], **args, expert_alignment=0)
    except ValueError:
        pass
    buffer.internode_dispatch(inp["x"], handle=handle)  # deep_ep's name for the same call
    low = low_latency_buffer(p)
    for _ in range(low_latency):
        rank_fns.low_latency_round(p, use_fp8=False, buffer=low)
    counts = buffer.stats()
    low_counts = low.stats()
    buffer.reset_stats()
    after_reset = buffer.stats()
    buffer.combine(y, handle, topk_weights=recv_w)
    return dict(counts=counts, low_counts=low_counts, after_reset=after_reset, after_combine=buffer.stats())


def cpu_topology(ranks_per_node: int = None) -> dict:
    """topology() of a normal Buffer and of a low-latency one, and what check_errors() returned after a
    round on each."""
    p = Problem(5, dist.get_world_size(), dist.get_world_size() * 2, 128, 2, max_tokens=8)
    extra = {} if ranks_per_node is None else dict(ranks_per_node=ranks_per_node)
    normal = normal_buffer(p.hidden, **extra)
    low = Buffer(dist.group.WORLD, 0, 1 << 22, low_latency_mode=True, **extra)
    before = normal.topology()
    rank_fns.normal_round(p, buffer=normal)  # normal_round asks check_errors() itself
    checked = normal.check_errors(), low.check_errors()
    return dict(normal=normal.topology(), before=before, low=low.topology(), checked=checked,
                build=moe_ep.backend_info())


def check_errors_after_destroy() -> str:
    buffer = Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True)
    buffer.destroy()
    try:
        buffer.check_errors()
    except RuntimeError as exc:
        return str(exc)
    return "no exception"


def one_pass_counts(p: Problem) -> dict:
    """stats() of a Buffer with an arena with room for every call (one pass: a dispatch, a cached one, a
    combine of an empty_combine_input) and of one without (two passes), the arena's numbers while the
    round's tensors live and after they died, and after reset_stats()."""
    rank = dist.get_rank()
    inp = my_inputs(p)
    results = {}
    for name, area in (("arena", arena_area(p)), ("two_pass", TWO_PASS)):
        buffer = normal_buffer(p.hidden, **area)
        empty = buffer.stats()  # before the first call of CUDA tensors: nothing mapped yet
        args = dispatch_args(buffer, inp, p)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(inp["x"], **args)
        cached = buffer.dispatch(inp["x"], handle=handle)[0]
        y = buffer.empty_combine_input(handle, p.hidden).copy_(expert_output(recv_x, rank))
        buffer.combine(y, handle, topk_weights=recv_w)
        live = buffer.stats()
        del recv_x, cached, y
        torch.cuda.synchronize()
        dead = buffer.stats()
        buffer.reset_stats()
        reset = buffer.stats()
        results[name] = dict(empty=empty, live=live, dead=dead, reset=reset, rows=handle.num_recv_rows,
                             size=area["num_arena_bytes"])
    return results


def gpu_topology(p: Problem) -> dict:
    """topology() of a normal and a low-latency Buffer before and after a round of each."""
    normal = normal_buffer(p.hidden)
    low = low_latency_buffer(p)
    before = normal.topology(), low.topology()
    rank_fns.normal_round(p, buffer=normal)
    rank_fns.low_latency_round(p, use_fp8=True, buffer=low)
    return dict(before=before, normal=normal.topology(), low=low.topology())


def overflow_reported(p: Problem, num_worst_tokens: int) -> list:
    """A num_worst_tokens dispatch that may receive more rows than that on the two-pass kernels, then
    check_errors() twice: what each raised ("" for nothing)."""
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, **TWO_PASS)
    buffer.dispatch(inp["x"], **dispatch_args(buffer, inp, p), num_worst_tokens=num_worst_tokens)
    outcomes = []
    for _ in range(2):
        try:
            buffer.check_errors()
            outcomes.append("")
        except ValueError as exc:
            outcomes.append(str(exc))
    return outcomes


# ---------------------------------------------------------------------------- CPU ranks
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_stats_count_every_call_on_the_portable_backend(pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 128, 3, max_tokens=16)
    for res in pools(num_ranks).run(counted_calls, p, cached=2, low_latency=3):
        want = dict(call_counts(), get_dispatch_layout=1, dispatch=1, cached_dispatch=3, combine=1)
        assert res["counts"]["calls"] == want, res["counts"]
        assert res["low_counts"]["calls"] == dict(call_counts(), low_latency_dispatch=3, low_latency_combine=3)
        for counted in (res["counts"], res["low_counts"], res["after_reset"], res["after_combine"]):
            assert counted["one_pass_calls"] == {"dispatch": 0, "combine": 0}
            assert counted["arena"] == {"capacity": 0, "in_use": 0, "high_water": 0, "regions": 0}
        assert res["after_reset"]["calls"] == call_counts()
        assert res["after_combine"]["calls"] == dict(call_counts(), combine=1)
    assert set(CALL_KINDS) == set(res["counts"]["calls"])


def test_topology_and_check_errors_on_cpu_ranks(pools):
    for rank, res in enumerate(pools(3).run(cpu_topology)):
        topo, low = res["normal"], res["low"]
        assert (topo["rank"], topo["num_ranks"], topo["ranks_per_node"], topo["node_of_rank"]) == (rank, 3, 3, [0] * 3)
        assert topo["build"] == res["build"]
        # CPU tensors run on the portable backend; CUDA tensors would run on the kernels where built.
        kernels = res["build"]["cuda_kernels"]
        assert topo["normal_backend"] == ("intranode" if kernels else "portable")
        assert (topo["portable_reasons"]["normal"] is None) == kernels
        if not kernels:
            assert topo["portable_reasons"]["normal"] == res["build"]["reason"]
        assert topo["low_latency_backend"] is None and topo["peers"]["low_latency"] is None
        assert low["low_latency_backend"] == ("low_latency" if kernels else "portable")
        assert low["normal_backend"] == "portable"  # no num_nvl_bytes
        assert "num_nvl_bytes > 0" in low["portable_reasons"]["normal"] or not kernels
        for t in (topo, res["before"], low):
            assert t["mapped"] == {"normal": False, "low_latency": False}
            assert t["peer_memory"] == {"normal": None, "low_latency": None}
            assert t["ranks_on_this_gpu"] == 1
        assert res["before"] == topo
        expected = ["self" if r == rank else "portable" for r in range(3)]
        if not kernels:
            assert topo["peers"]["normal"] == expected and low["peers"]["low_latency"] == expected
        assert res["checked"] == (None, None)


def test_topology_names_each_ranks_node(pools):
    for rank, res in enumerate(pools(4).run(cpu_topology, ranks_per_node=2)):
        topo = res["normal"]
        assert topo["node_of_rank"] == [0, 0, 1, 1] and topo["ranks_per_node"] == 2
        # The kernels serve the ranks of one node: this group runs on the portable backend.
        assert topo["normal_backend"] == "portable" and topo["peers"]["normal"][rank] == "self"
        if res["build"]["cuda_kernels"]:
            assert "nodes" in topo["portable_reasons"]["normal"]


def test_check_errors_on_a_destroyed_buffer_says_so(pools):
    assert all("destroyed" in message for message in pools(2).run(check_errors_after_destroy))


def test_the_arena_counts_bytes_in_use_and_their_high_water_mark():
    arena = Arena(1024, 16)
    assert arena.usage() == {"capacity": 1024, "in_use": 0, "high_water": 0, "regions": 0}
    a = arena.alloc(100)  # 112 bytes
    b = arena.alloc(200)  # 208
    assert arena.usage() == {"capacity": 1024, "in_use": 320, "high_water": 320, "regions": 2}
    start, length = arena.reserve_largest()  # the rest, held until the call knows its size
    assert arena.usage()["in_use"] == 1024 and arena.usage()["high_water"] == 320
    arena.shrink(start, 64)  # what the call kept counts
    assert arena.usage() == {"capacity": 1024, "in_use": 384, "high_water": 384, "regions": 3}
    arena.free(a)
    arena.release(b)  # as a dying region gives it back
    assert arena.usage() == {"capacity": 1024, "in_use": 64, "high_water": 384, "regions": 1}
    start, _ = arena.reserve_largest()
    arena.free(start)  # a reservation given back unused never counts
    assert arena.usage()["high_water"] == 384
    arena.reset_high_water()
    assert arena.usage() == {"capacity": 1024, "in_use": 64, "high_water": 64, "regions": 1}


def test_stats_read_the_kernel_backends_counters_and_arena(monkeypatch):
    """Buffer.stats over an intranode backend whose launches are stubbed (test_arena.py's): the arena's
    bytes as the dispatches' regions come and go, and the device counter the one-pass kernels add to."""
    from moe_ep.bench.profile_dispatch_call import stub_backend
    from moe_ep.config import arena_dispatch_region
    from moe_ep.diagnostics import reset_stats

    tokens, hidden, topk, ranks = 16, 64, 2, 3
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    topk_idx = torch.rand(tokens, 6).topk(topk, dim=1).indices
    backend, call = stub_backend(ranks, x, topk_idx, torch.rand(tokens, topk), 6, monkeypatch.setattr, arena=True)
    buffer = types.SimpleNamespace(_intranode=backend, _calls=call_counts(), _traffic=Traffic(0, ranks),
                                   num_nvl_bytes=1 << 20, num_rdma_bytes=0)
    region = arena_dispatch_region(ranks * tokens, 2 * hidden, 0, topk).slot_bytes
    first, second = call([x])[0][0], call([x])[0][0]
    backend.one_pass_calls += torch.tensor([2, 1], dtype=torch.int32)  # as the kernels would count
    got = diagnostics_stats(buffer)
    assert got["one_pass_calls"] == {"dispatch": 2, "combine": 1}
    assert got["arena"] == {"capacity": backend.arena.size, "in_use": 2 * region, "high_water": 2 * region,
                            "regions": 2}
    assert got["buffer_capacity"] == {"nvl": 1 << 20, "rdma": 0, "arena": backend.arena.size}
    assert got["buffer_high_water"]["arena"] == 2 * region
    del first
    assert diagnostics_stats(buffer)["arena"] == {"capacity": backend.arena.size, "in_use": region,
                                                  "high_water": 2 * region, "regions": 1}
    reset_stats(buffer)
    got = diagnostics_stats(buffer)
    assert got["one_pass_calls"] == {"dispatch": 0, "combine": 0}
    assert got["arena"]["high_water"] == region == got["arena"]["in_use"]
    del second


# ---------------------------------------------------------------------------- GPU ranks (the kernels)
@pytest.mark.gpu
@kernels_only
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_one_pass_calls_and_arena_bytes_on_the_kernels(gpu_pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=48)
    for rank, res in enumerate(gpu_pools(num_ranks).run(one_pass_counts, p)):
        arena, two_pass = res["arena"], res["two_pass"]
        zero = {"capacity": 0, "in_use": 0, "high_water": 0, "regions": 0}
        for r in (arena, two_pass):
            assert r["empty"]["one_pass_calls"] == {"dispatch": 0, "combine": 0} and r["empty"]["arena"] == zero
            assert r["live"]["calls"] == dict(call_counts(), get_dispatch_layout=1, dispatch=1, cached_dispatch=1,
                                              combine=1)
            assert r["reset"]["one_pass_calls"] == {"dispatch": 0, "combine": 0}
        # With room for every call, each ran in one pass; without an arena none did.
        assert arena["live"]["one_pass_calls"] == {"dispatch": 2, "combine": 1}, f"seed {seed} rank {rank}"
        assert two_pass["live"]["one_pass_calls"] == {"dispatch": 0, "combine": 0}
        assert two_pass["live"]["arena"] == zero and two_pass["dead"]["arena"] == zero
        live, dead = arena["live"]["arena"], arena["dead"]["arena"]
        assert live["capacity"] == dead["capacity"] > 0 and live["capacity"] <= arena["size"]
        if arena["rows"]:  # recv_x, the cached recv_x and the combine input hold regions
            assert live["regions"] == 3 and live["in_use"] >= arena["rows"] * p.hidden * 2 * 3
        assert live["high_water"] >= live["in_use"]
        assert dead["in_use"] == 0 and dead["regions"] == 0 and dead["high_water"] == live["high_water"]
        assert arena["reset"]["arena"]["high_water"] == 0


@pytest.mark.gpu
@kernels_only
def test_topology_on_the_kernels(gpu_pools, seed):
    p = Problem(seed, 2, 8, 256, 4, max_tokens=32)
    for rank, res in enumerate(gpu_pools(2).run(gpu_topology, p)):
        normal, low = res["normal"], res["low"]
        before_normal, before_low = res["before"]
        assert before_normal["normal_backend"] == "intranode" and before_low["low_latency_backend"] == "low_latency"
        assert before_normal["mapped"]["normal"] is False and before_normal["peers"]["normal"][1 - rank] is None
        assert normal["mapped"]["normal"] and normal["peer_memory"]["normal"] in ("vmm", "ipc")
        assert low["mapped"]["low_latency"] and low["peer_memory"]["low_latency"] in ("vmm", "ipc", "nvshmem")
        for paths in (normal["peers"]["normal"], low["peers"]["low_latency"]):
            assert paths[rank] == "self"
            assert paths[1 - rank] == ("same_gpu" if normal["ranks_on_this_gpu"] == 2 else "nvlink"), paths


@pytest.mark.gpu
@kernels_only
def test_check_errors_reports_a_num_worst_tokens_overflow_once(gpu_pools, seed):
    p = Problem(seed, 3, 24, 512, 6, max_tokens=96)
    inputs = make_inputs(p)
    received = [len(ref_dispatch(p, inputs, rank)[0]) for rank in range(3)]
    worst = max(1, min(37, max(received) - 1))
    for rank, outcomes in enumerate(gpu_pools(3).run(overflow_reported, p, worst)):
        if received[rank] > worst:
            assert "num_worst_tokens" in outcomes[0] and outcomes[1] == "", outcomes
        else:
            assert outcomes == ["", ""], outcomes


def test_kernel_backend_is_none_on_the_portable_backend(pools):
    assert pools(2).run(_kernel_backends) == [(None, None)] * 2


def _kernel_backends():
    buffer = Buffer(dist.group.WORLD, 1 << 20, 1 << 22, low_latency_mode=True)
    inp = my_inputs(Problem(3, dist.get_world_size(), 8, 128, 2, max_tokens=4))
    buffer.get_dispatch_layout(inp["topk_idx"], 8)
    return kernel_backend(buffer), kernel_backend(buffer, "low_latency")
