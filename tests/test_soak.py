"""Long GPU runs: random rounds on every kernel path against the portable backend with the allocator
flat, CUDA-graph replays on new data, and a rank killed in the middle of a call.

The counts come from the environment so that the standing runs of docs/RELIABILITY.md (10,000 rounds a
path, 1,000 replays) and a quick GPU test run share the tests: MOE_EP_SOAK_ROUNDS (default 200),
MOE_EP_GRAPH_REPLAYS (default 50).
"""
import json
import os
import time

import pytest
import torch

from moe_ep import _native
from moe_ep.launch import RankError, RankPool

from . import rank_fns, soak_fns

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason())),
]
KERNELS = {"MOE_EP_BACKEND": "kernels"}
ROUNDS = int(os.environ.get("MOE_EP_SOAK_ROUNDS", "200"))
REPLAYS = int(os.environ.get("MOE_EP_GRAPH_REPLAYS", "50"))
# Rounds a pool call: well inside its timeout, and at least four calls, so that the allocator's bytes are
# compared at three points after the first.
CHUNK = max(1, min(250, ROUNDS // 4))


def _soak(gpu_pools, num_ranks, fn, seed, **kwargs):
    """ROUNDS rounds of fn in pool calls of CHUNK; every rank's mismatches, and the allocator's bytes after
    each call."""
    pool = gpu_pools(num_ranks)
    memory = []
    started = time.monotonic()
    try:
        for start in range(0, ROUNDS, CHUNK):
            print(f"{fn.__name__} {kwargs}: round {start} at {time.monotonic() - started:.1f} s", flush=True)
            results = pool.run(rank_fns.with_env, KERNELS, fn, seed, start, min(CHUNK, ROUNDS - start), **kwargs)
            for rank, result in enumerate(results):
                assert not result["mismatches"], f"seed {seed} rank {rank}: {result['mismatches'][:5]}"
            memory.append([(r["allocated"], r["reserved"]) for r in results])
    finally:
        pool.run(soak_fns.drop_soak_buffers)
    # After the first call every tensor a round makes is freed again: the bytes in use stay where they were.
    for rank in range(num_ranks):
        allocated = [m[rank][0] for m in memory]
        assert allocated == allocated[:1] * len(allocated), f"seed {seed} rank {rank}: allocated bytes {allocated}"
    return memory


@pytest.mark.parametrize("num_ranks", [4])
def test_intranode_soak(gpu_pools, seed, num_ranks):
    _soak(gpu_pools, num_ranks, soak_fns.normal_soak, seed)


@pytest.mark.parametrize("num_ranks", [4])
def test_low_latency_soak(gpu_pools, seed, num_ranks):
    _soak(gpu_pools, num_ranks, soak_fns.low_latency_soak, seed)


@pytest.mark.skipif(not _native.has_nvshmem_device(), reason=str(_native.internode_unavailable_reason()))
@pytest.mark.parametrize("num_ranks, ranks_per_node", [(4, 2)])
def test_internode_soak(gpu_pools, seed, num_ranks, ranks_per_node):
    _soak(gpu_pools, num_ranks, soak_fns.normal_soak, seed, ranks_per_node=ranks_per_node)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_normal_graph_replays_on_new_data(gpu_pools, seed, use_fp8):
    """The no-sync normal path (layout, dispatch with num_worst_tokens, combine) in one graph: REPLAYS
    replays, new tokens and routing each time, each equal to the portable backend; no allocation grows."""
    results = gpu_pools(4).run(rank_fns.with_env, KERNELS, soak_fns.normal_graph_replays, seed, REPLAYS, use_fp8)
    for rank, result in enumerate(results):
        assert not result["mismatches"], f"seed {seed} rank {rank}: {result['mismatches'][:5]}"
        assert result["after"] == result["before"], f"seed {seed} rank {rank}: {result}"


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_graph_replays_on_new_data(gpu_pools, seed, use_fp8):
    results = gpu_pools(4).run(rank_fns.with_env, KERNELS, soak_fns.low_latency_graph_replays, seed, REPLAYS, use_fp8)
    for rank, result in enumerate(results):
        assert not result["mismatches"], f"seed {seed} rank {rank}: {result['mismatches'][:5]}"
        assert result["after"] == result["before"], f"seed {seed} rank {rank}: {result}"


TIMEOUT_S = 5.0


@pytest.mark.parametrize("kind", ["normal", "low_latency"])
def test_a_rank_killed_mid_call(tmp_path, kind):
    """Rank 2 of 4 is SIGKILLed in the middle of a call (its own pool: the pool loses the rank). The
    survivors raise TimeoutError naming it within the timeout and some seconds, from the host or from the
    kernels' report, and the Buffer then says it is out of step; no kernel traps, nothing hangs."""
    env = {"MOE_EP_TEST_CUDA": "1", **KERNELS, "MOE_EP_TIMEOUT_S": str(TIMEOUT_S)}
    with RankPool(4, use_cuda=True, backend="gloo", env=env, call_timeout_s=120) as pool:
        with pytest.raises(RankError) as lost:
            pool.run(soak_fns.killed_mid_call, kind, 2, str(tmp_path))
    assert [(f.rank, f.type_name) for f in lost.value.failures] == [(2, "RankLost")], str(lost.value)
    for rank in (0, 1, 3):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["raised"] is not None and outcome["raised"][0] == "TimeoutError", outcome
        assert "rank 2" in outcome["raised"][1] or "rank(s) 2" in outcome["raised"][1], outcome
        assert outcome["after_s"] < TIMEOUT_S + 15, outcome
        assert outcome["later"] is not None and outcome["later"][0] in ("TimeoutError", "RuntimeError"), outcome
        assert outcome["later_after_s"] < TIMEOUT_S + 15, outcome
