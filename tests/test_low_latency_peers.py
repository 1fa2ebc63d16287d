"""Which peers `moe-ep-bench low_latency` times beside moe_ep: DeepEP's low-latency calls are skipped, with
the reason printed, where they cannot start (ranks sharing a GPU), instead of waiting out --peer-timeout."""
import types

from moe_ep.bench import low_latency, peers

CHECKS = dict(deep_ep_check=lambda: "", portable_check=lambda: "")


def _args(**over):
    base = dict(cpu=False, peers=list(peers.PEERS), portable_any_size=False, tokens=128, hidden=7168)
    return types.SimpleNamespace(**{**base, **over})


def test_deep_eps_low_latency_calls_are_skipped_where_ranks_share_a_gpu():
    reasons = low_latency.peer_skip_reasons(_args(), 8, 1, {}, **CHECKS)
    assert reasons["deep_ep"] == ("8 ranks share 1 GPU(s): DeepEP's low-latency mode starts NVSHMEM's IBGDA "
                                  "transport, which needs a GPU a rank (run with one rank per GPU)")
    assert reasons["portable"] == reasons["copy"] == ""


def test_deep_eps_low_latency_calls_run_where_each_rank_has_a_gpu():
    assert low_latency.peer_skip_reasons(_args(), 4, 4, {}, **CHECKS)["deep_ep"] == ""
    assert low_latency.peer_skip_reasons(_args(), 4, 8, {}, **CHECKS)["deep_ep"] == ""


def test_deep_eps_normal_calls_still_run_on_ranks_sharing_a_gpu():
    """Its intranode calls map peers through CUDA IPC, no NVSHMEM: the intranode benchmark keeps them."""
    assert peers.skip_reasons(_args(), 8, 1, 1 << 20, **CHECKS)["deep_ep"] == ""


def test_a_missing_deep_ep_or_cpu_ranks_are_named_first():
    missing = low_latency.peer_skip_reasons(_args(), 8, 1, {}, deep_ep_check=lambda: "import deep_ep failed (x)",
                                            portable_check=lambda: "")
    assert missing["deep_ep"] == "import deep_ep failed (x)"
    on_cpu = low_latency.peer_skip_reasons(_args(cpu=True), 2, 0, {}, **CHECKS)
    assert on_cpu["deep_ep"] == "CPU ranks (--cpu): DeepEP's calls take CUDA tensors"
    asked_not = low_latency.peer_skip_reasons(_args(peers=["copy"]), 8, 1, {}, **CHECKS)
    assert asked_not["deep_ep"] == "not asked for (--peers)"
