"""deep_ep V1's Buffer surface on moe_ep: every method and argument with deep_ep's name, position and
default; the additions run through the public API; what moe_ep does not do is refused by name."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import Buffer, Config, EventOverlap
from moe_ep.buffer import default_config_size_hints

from .problems import Problem, bias_for, expert_output, make_inputs, ref_combine, ref_dispatch, ref_recv_x, same_bits
from .rank_fns import cpu, low_latency_buffer, my_inputs, normal_buffer, normal_round
from .test_low_latency import _check_combine, _check_recv

REQUIRED = inspect.Parameter.empty

# deep_ep V1 (commit 567632d), written down as (argument, default) in positional order; REQUIRED: no default.
_DISPATCH = [
    ("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
    ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
    ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
    ("async_finish", False), ("allocate_on_comm_stream", False),
]
_COMBINE = [
    ("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None), ("config", None),
    ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False),
]
V1_METHODS = {
    "__init__": [
        ("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
        ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
        ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None),
    ],
    "destroy": [],
    "get_comm_stream": [],
    "get_local_buffer_tensor": [("dtype", REQUIRED), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_dispatch_layout": [
        ("topk_idx", REQUIRED), ("num_experts", REQUIRED), ("previous_event", None), ("async_finish", False),
        ("allocate_on_comm_stream", False),
    ],
    "dispatch": _DISPATCH,
    "combine": _COMBINE,
    "internode_dispatch": _DISPATCH,
    "internode_combine": _COMBINE,
    "clean_low_latency_buffer": [
        ("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED), ("num_experts", REQUIRED),
    ],
    "low_latency_dispatch": [
        ("x", REQUIRED), ("topk_idx", REQUIRED), ("num_max_dispatch_tokens_per_rank", REQUIRED),
        ("num_experts", REQUIRED), ("cumulative_local_expert_recv_stats", None),
        ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False),
        ("async_finish", False), ("return_recv_hook", False),
    ],
    "low_latency_combine": [
        ("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED), ("handle", REQUIRED),
        ("use_logfmt", False), ("zero_copy", False), ("async_finish", False), ("return_recv_hook", False),
        ("out", None), ("combine_wait_recv_cost_stats", None),
    ],
    "low_latency_update_mask_buffer": [("rank_to_mask", REQUIRED), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", REQUIRED)],
    "low_latency_clean_mask_buffer": [],
    "get_next_low_latency_combine_buffer": [("handle", REQUIRED)],
}
V1_STATIC_METHODS = {
    "is_sm90_compiled": [],
    "set_num_sms": [("new_num_sms", REQUIRED)],
    "capture": [],
    "get_low_latency_rdma_size_hint": [
        ("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED), ("num_ranks", REQUIRED),
        ("num_experts", REQUIRED),
    ],
    "get_dispatch_config": [("num_ranks", REQUIRED)],
    "get_combine_config": [("num_ranks", REQUIRED)],
}
V1_CONFIG_INIT = [
    ("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
    ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256),
]
V1_EVENT_OVERLAP_INIT = [("event", None), ("extra_tensors", None)]
# What every V1 Buffer carries once made (deep_ep's `runtime`, its C++ object, has no counterpart).
V1_ATTRIBUTES = ("rank", "group", "group_size", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode",
                 "explicitly_destroy", "enable_shrink", "num_sms")


def _check_signature(fn, expected, what: str, skip_self: bool = True) -> None:
    """The V1 arguments come first with deep_ep's names, kinds and defaults; moe_ep's own come after them
    with defaults (or keyword-only), so every V1 call, positional or by keyword, binds the same way."""
    params = list(inspect.signature(fn).parameters.values())[1 if skip_self else 0:]
    got = [(p.name, p.default) for p in params[:len(expected)]]
    assert got == expected, f"{what}: expected {expected}, got {got}"
    for p in params[:len(expected)]:
        assert p.kind == p.POSITIONAL_OR_KEYWORD, f"{what}: {p.name} must be positional or keyword, is {p.kind}"
    for p in params[len(expected):]:
        assert p.kind == p.KEYWORD_ONLY or p.default is not REQUIRED, f"{what}: extra argument {p.name} is required"


@pytest.mark.parametrize("name", sorted(V1_METHODS))
def test_every_v1_method_has_deep_eps_arguments(name):
    assert name in vars(Buffer), f"Buffer.{name} is missing"
    assert not isinstance(inspect.getattr_static(Buffer, name), staticmethod), f"Buffer.{name} must be a method"
    _check_signature(getattr(Buffer, name), V1_METHODS[name], f"Buffer.{name}")


@pytest.mark.parametrize("name", sorted(V1_STATIC_METHODS))
def test_every_v1_static_method_has_deep_eps_arguments(name):
    assert isinstance(inspect.getattr_static(Buffer, name), staticmethod), f"Buffer.{name} must be a staticmethod"
    _check_signature(getattr(Buffer, name), V1_STATIC_METHODS[name], f"Buffer.{name}", skip_self=False)


def test_module_names_config_and_event_overlap_are_deep_eps():
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert hasattr(moe_ep, name), f"moe_ep.{name} is missing"
    assert moe_ep.topk_idx_t is torch.int64
    assert isinstance(Buffer.num_sms, int)
    _check_signature(Config, V1_CONFIG_INIT, "Config", skip_self=False)
    for hint in ("get_nvl_buffer_size_hint", "get_rdma_buffer_size_hint"):  # (hidden_bytes, num_ranks)
        assert getattr(Config(), hint)(7168 * 2, 16) >= 0
    _check_signature(EventOverlap, V1_EVENT_OVERLAP_INIT, "EventOverlap", skip_self=False)
    for name, num_args in (("current_stream_wait", 0), ("__enter__", 0), ("__exit__", 3)):
        params = list(inspect.signature(getattr(EventOverlap, name)).parameters.values())[1:]
        assert len(params) == num_args, f"EventOverlap.{name}: expected {num_args} arguments"


# ------------------------------------------------------------------------ functions the ranks run
def v1_attributes():
    buffer = normal_buffer(128)
    return {name: repr(getattr(buffer, name)) for name in V1_ATTRIBUTES if name != "group"} | {
        "group_is_world": buffer.group is dist.group.WORLD}


def internode_and_plain_rounds(p: Problem, ranks_per_node: int):
    """A round through internode_dispatch / internode_combine and one through dispatch / combine, each
    called as deep_ep's dispatch calls its internode twin (positionally, with a config), on one Buffer."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    inp = my_inputs(p)
    buffer = normal_buffer(p.hidden, ranks_per_node=ranks_per_node)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(inp["topk_idx"], p.num_experts)
    bias = bias_for(p, rank, inp["x"].shape[0], 0)
    results = {}
    for name, dispatch, combine in (("internode", buffer.internode_dispatch, buffer.internode_combine),
                                    ("plain", buffer.dispatch, buffer.combine)):
        recv_x, recv_idx, recv_w, counts, handle, event = dispatch(
            inp["x"], None, per_rank, per_rdma, in_rank, per_expert, inp["topk_idx"], inp["topk_weights"], 1, 0,
            Buffer.get_dispatch_config(num_ranks), None, False, False)
        cached = dispatch(inp["x"], handle, config=Buffer.get_dispatch_config(num_ranks))
        y = expert_output(recv_x, rank)
        combined, combined_w, _ = combine(y, handle, recv_w, bias, Buffer.get_combine_config(num_ranks),
                                          None, False, False)
        results[name] = cpu(dict(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, counts=counts,
                                 cached=cached[:5], combined=combined, combined_w=combined_w))
    return per_rdma is not None, results


def low_latency_positional_round(p: Problem):
    """A low-latency round with every V1 argument passed positionally (use_fp8=False sits seventh)."""
    inp = my_inputs(p)
    buffer = low_latency_buffer(p)
    stats = torch.zeros(p.local_experts, dtype=torch.int32)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
        inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, stats, None, False, False, False, False, False)
    y = expert_output(recv_x, dist.get_rank())
    combined, _, _ = buffer.low_latency_combine(
        y, inp["topk_idx"], inp["topk_weights"], handle, False, False, False, False, None, None)
    return cpu(dict(recv_x=recv_x, recv_count=recv_count, stats=stats, y=y, combined=combined))


def transport_arguments_round(p: Problem):
    """The transport-only arguments at values other than their defaults (passed positionally, as V1
    allows), their type checks, then a normal round on that Buffer."""
    outcomes = []
    for name, kwargs in (("num_qps_per_rank", dict(num_qps_per_rank="24")),
                         ("allow_mnnvl", dict(allow_mnnvl=1)),
                         ("use_fabric", dict(use_fabric="yes"))):
        try:
            Buffer(dist.group.WORLD, **kwargs)
            outcomes.append((name, "returned", ""))
        except Exception as exc:  # noqa: BLE001
            outcomes.append((name, type(exc).__name__, str(exc)))
    nvl, rdma = default_config_size_hints(p.hidden * 2, p.num_ranks)
    buffer = Buffer(dist.group.WORLD, nvl, rdma, False, 3, False, True, True, False, False, None)
    return outcomes, normal_round(p, buffer=buffer)


def _attempt(outcomes: list, name: str, call) -> None:
    try:
        call()
        outcomes.append((name, "returned", ""))
    except Exception as exc:  # noqa: BLE001
        outcomes.append((name, type(exc).__name__, str(exc)))


def refusals_then_round(p: Problem):
    """Every V1 argument and method moe_ep refuses, each on every rank, with a valid low-latency round
    around them: the dispatch refused before the round's dispatch, the combine refused between the
    round's dispatch and its combine (with the same handle)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    inp = my_inputs(p)
    outcomes = []
    _attempt(outcomes, "comm", lambda: Buffer(None, comm=object()))  # any object stands for an mpi4py comm
    buffer = low_latency_buffer(p)
    _attempt(outcomes, "low_latency_update_mask_buffer", lambda: buffer.low_latency_update_mask_buffer(0, True))
    _attempt(outcomes, "low_latency_query_mask_buffer",
             lambda: buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int32)))
    _attempt(outcomes, "low_latency_clean_mask_buffer", lambda: buffer.low_latency_clean_mask_buffer())
    wait_stats = torch.zeros(num_ranks, dtype=torch.int64)
    _attempt(outcomes, "dispatch_wait_recv_cost_stats", lambda: buffer.low_latency_dispatch(
        inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, dispatch_wait_recv_cost_stats=wait_stats))
    stats = torch.zeros(p.local_experts, dtype=torch.int32)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
        inp["x"], inp["topk_idx"], p.max_tokens, p.num_experts, cumulative_local_expert_recv_stats=stats,
        use_fp8=False)
    y = expert_output(recv_x, rank)
    _attempt(outcomes, "use_logfmt", lambda: buffer.low_latency_combine(
        y, inp["topk_idx"], inp["topk_weights"], handle, use_logfmt=True))
    _attempt(outcomes, "use_logfmt type", lambda: buffer.low_latency_combine(
        y, inp["topk_idx"], inp["topk_weights"], handle, use_logfmt=1))
    _attempt(outcomes, "combine_wait_recv_cost_stats", lambda: buffer.low_latency_combine(
        y, inp["topk_idx"], inp["topk_weights"], handle, combine_wait_recv_cost_stats=wait_stats))
    combined, _, _ = buffer.low_latency_combine(y, inp["topk_idx"], inp["topk_weights"], handle)
    return outcomes, bool((wait_stats == 0).all()), cpu(dict(
        recv_x=recv_x, recv_count=recv_count, stats=stats, y=y, combined=combined))


# ------------------------------------------------------------------------ behaviour on CPU ranks
def test_a_buffer_has_deep_eps_attributes(pools):
    for rank, attrs in enumerate(pools(2).run(v1_attributes)):
        assert attrs["rank"] == str(rank) and attrs["group_size"] == "2" and attrs["group_is_world"]
        assert attrs["low_latency_mode"] == attrs["explicitly_destroy"] == attrs["enable_shrink"] == "False"
        assert int(attrs["num_nvl_bytes"]) > 0 and int(attrs["num_sms"]) == Buffer.num_sms


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(2, 2), (4, 2)])
def test_internode_dispatch_and_combine_are_dispatch_and_combine(pools, seed, num_ranks, ranks_per_node):
    p = Problem(seed, num_ranks, num_ranks * 3, 256, 4)
    inputs = make_inputs(p)
    results = pools(num_ranks).run(internode_and_plain_rounds, p, ranks_per_node)
    received = [ref_dispatch(p, inputs, dst)[0] for dst in range(num_ranks)]
    returned = [expert_output(ref_recv_x(inputs, received[dst]), dst) for dst in range(num_ranks)]
    for rank, (has_rdma_counts, res) in enumerate(results):
        assert has_rdma_counts == (ranks_per_node < num_ranks)
        for key, value in res["plain"].items():
            assert same_bits(res["internode"][key], value), f"seed {seed} rank {rank}: internode {key} differs"
        internode = res["internode"]
        sources, idx_rows, _, per_expert = ref_dispatch(p, inputs, rank)
        assert torch.equal(internode["recv_x"], ref_recv_x(inputs, sources)), f"seed {seed} rank {rank}: recv_x"
        assert internode["recv_idx"].tolist() == idx_rows and internode["counts"] == per_expert
        assert torch.equal(internode["cached"][0], internode["recv_x"])
        assert internode["cached"][1:] == (None, None, None, None)
        bias = bias_for(p, rank, inputs[rank]["x"].shape[0], 0)
        # Across nodes each node's rows are summed first (the contract's order there).
        want = ref_combine(p, inputs, received, returned, rank, [bias], ranks_per_node)
        assert torch.equal(internode["combined"], want), f"seed {seed} rank {rank}: combined_x"


def test_low_latency_calls_take_v1_arguments_by_position(pools, seed):
    p = Problem(seed, 3, 6, 256, 3, max_tokens=16)
    results = pools(3).run(low_latency_positional_round, p)
    inputs = make_inputs(p)
    _check_recv(p, inputs, results, use_fp8=False)
    _check_combine(p, inputs, results, use_fp8=False)


def test_transport_arguments_are_type_checked_and_change_nothing(pools, seed):
    p = Problem(seed, 2, 6, 128, 3)
    inputs = make_inputs(p)
    for rank, (outcomes, res) in enumerate(pools(2).run(transport_arguments_round, p)):
        for name, type_name, message in outcomes:
            assert type_name == "TypeError" and message.startswith(f"{name}: expected"), (name, type_name, message)
        sources = ref_dispatch(p, inputs, rank)[0]
        assert torch.equal(res["recv_x"], ref_recv_x(inputs, sources)), f"seed {seed} rank {rank}: recv_x"
        received = [ref_dispatch(p, inputs, dst)[0] for dst in range(2)]
        returned = [expert_output(ref_recv_x(inputs, received[dst]), dst) for dst in range(2)]
        assert torch.equal(res["combined"], ref_combine(p, inputs, received, returned, rank, []))


# (call, exception, what the message starts with, what it says to do instead)
REFUSALS = [
    ("comm", "NotImplementedError", "comm: moe_ep bootstraps through a torch.distributed ProcessGroup",
     "pass group="),
    ("low_latency_update_mask_buffer", "RuntimeError", "low_latency_update_mask_buffer needs a Buffer created with "
     "enable_shrink=True", "every rank of the group takes part"),
    ("low_latency_query_mask_buffer", "RuntimeError", "low_latency_query_mask_buffer needs a Buffer created with "
     "enable_shrink=True", "every rank of the group takes part"),
    ("low_latency_clean_mask_buffer", "RuntimeError", "low_latency_clean_mask_buffer needs a Buffer created with "
     "enable_shrink=True", "every rank of the group takes part"),
    ("dispatch_wait_recv_cost_stats", "NotImplementedError", "dispatch_wait_recv_cost_stats: moe_ep does not measure",
     "pass dispatch_wait_recv_cost_stats=None"),
    ("use_logfmt", "NotImplementedError", "use_logfmt: moe_ep sends combine rows as bf16", "pass use_logfmt=False"),
    ("use_logfmt type", "TypeError", "use_logfmt: expected a bool, got int", ""),
    ("combine_wait_recv_cost_stats", "NotImplementedError", "combine_wait_recv_cost_stats: moe_ep does not measure",
     "pass combine_wait_recv_cost_stats=None"),
]


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_unsupported_v1_arguments_are_refused_by_name_and_the_buffer_stays_exact(pools, seed, num_ranks):
    p = Problem(seed, num_ranks, num_ranks * 2, 256, 3, max_tokens=16)
    results = pools(num_ranks).run(refusals_then_round, p)
    inputs = make_inputs(p)
    for rank, (outcomes, stats_untouched, _) in enumerate(results):
        assert [o[0] for o in outcomes] == [r[0] for r in REFUSALS]
        for (name, type_name, start, advice), (_, got_type, message) in zip(REFUSALS, outcomes):
            assert got_type == type_name, f"rank {rank}, {name}: raised {got_type}: {message}"
            assert message.startswith(start) and advice in message, f"rank {rank}, {name}: {message!r}"
        assert stats_untouched, "a refused call writes nothing"
    rounds = [res for _, _, res in results]
    _check_recv(p, inputs, rounds, use_fp8=False)
    _check_combine(p, inputs, rounds, use_fp8=False)
