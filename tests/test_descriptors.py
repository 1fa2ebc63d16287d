"""File descriptors between ranks (how buffers exported through the virtual-memory API reach the
peers), and the choice of peer memory; CPU only."""
import pytest

from . import rank_fns


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_every_rank_receives_every_peers_descriptor(pools, num_ranks):
    results = pools(num_ranks).run(rank_fns.descriptor_round)
    for rank, (payloads, received) in enumerate(results):
        assert payloads == [bytes([r]) * (r + 1) for r in range(num_ranks)]
        assert received == {r: f"rank {r}" for r in range(num_ranks) if r != rank}


def test_a_rank_that_never_hands_out_its_descriptor_is_named(pools):
    results = pools(2).run(rank_fns.with_env, {"MOE_EP_TIMEOUT_S": "1.5"}, rank_fns.descriptor_round, skipping_rank=1)
    assert results[1] is None
    kind, message = results[0]
    assert kind == "TimeoutError" and "rank(s) 1 did not arrive" in message, message


def test_a_rank_that_cannot_reach_its_peers_fails_every_rank_alike_and_at_once(pools):
    """Every rank raises DescriptorsUnavailable naming the rank (map_peer_buffers then falls back to
    CUDA IPC handles on every rank together), well before the 60 s deadline a peer's server has."""
    results = pools(3).run(rank_fns.with_env, {"MOE_EP_TIMEOUT_S": "60"}, rank_fns.descriptor_round,
                           unreachable_rank=2)
    for kind, message in results:
        assert kind == "DescriptorsUnavailable", (kind, message)
        assert "rank 2 could not fetch rank 0's memory descriptor (test: refused)" in message, message
    # Waiting on the servers first would end in a TimeoutError after 60 s instead (the kind checked above).


@pytest.mark.parametrize("choice", ["peer_memory", "low_latency_memory"])
def test_an_unknown_peer_memory_is_refused_by_name(choice):
    from moe_ep.backends.choices import kernel_choices, overridden
    with pytest.raises(ValueError, match=f"{choice}: expected one of .*'vmm', 'ipc'.*got 'shared'"):
        with overridden(**{choice: "shared"}):
            pass
    assert getattr(kernel_choices, choice) == "auto"


def test_nvshmem_is_for_the_low_latency_buffers_only():
    from moe_ep.backends.choices import kernel_choices, overridden
    with pytest.raises(ValueError, match="peer_memory: expected one of .*got 'nvshmem'"):
        with overridden(peer_memory="nvshmem"):
            pass
    with overridden(low_latency_memory="nvshmem"):
        assert kernel_choices.low_latency_memory == "nvshmem"
