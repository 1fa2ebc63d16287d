"""Rank functions of tests/test_faults.py: one rank spoils a call (or misses it, or comes late) while the
others make it as they should; each returns what every call raised, and whether a valid round on the
same group (and, where the Buffer stays usable, on the same Buffer) then worked."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from moe_ep import Buffer, Config

from .rank_fns import with_env

HIDDEN = 128
NUM_TOPK = 2
NUM_TOKENS = 6
MAX_TOKENS = 8  # low-latency tokens per rank
TIMEOUT_S = 4.0  # the peers' deadline in these tests


def experts_per_rank() -> int:
    return 3


def num_experts() -> int:
    return experts_per_rank() * dist.get_world_size()


def nvl_bytes() -> int:
    return Config().get_nvl_buffer_size_hint(HIDDEN * 2, dist.get_world_size()) * 4


def rdma_bytes() -> int:
    return Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, dist.get_world_size(), num_experts())


def make_buffer(**kwargs) -> Buffer:
    """A Buffer for both kinds of calls (normal and low-latency) with the tests' short timeout."""
    args = dict(num_nvl_bytes=nvl_bytes(), num_rdma_bytes=rdma_bytes(), low_latency_mode=True, timeout_s=TIMEOUT_S)
    args.update(kwargs)
    return Buffer(dist.group.WORLD, **args)


def inputs():
    """This rank's tokens: token 0 goes to no expert, token 1 to one, the others to two distinct experts."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    idx = torch.stack([torch.randperm(num_experts(), generator=g)[:NUM_TOPK] for _ in range(NUM_TOKENS)])
    idx[0] = -1
    idx[1, 1] = -1
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    w = torch.rand(NUM_TOKENS, NUM_TOPK, generator=g)
    return x, idx, w


def valid_round(buffer: Buffer) -> str:
    """Layout, dispatch, combine and a low-latency dispatch and combine, each result checked."""
    x, idx, w = inputs()
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts())
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    combined, _, _ = buffer.combine(recv_x, handle)
    # Each token comes back once from every rank it went to; doubling a bf16 value is exact.
    expected = x.float() * in_rank.sum(1, keepdim=True).float()
    assert torch.equal(combined.float(), expected), "combine returned other values than the tokens sent"
    recv, _, ll_handle, _, _ = buffer.low_latency_dispatch(x, idx, MAX_TOKENS, num_experts(), use_fp8=False)
    buffer.low_latency_combine(recv, idx, w, ll_handle)
    return "passed"


def _outcome(fn):
    try:
        fn()
        return "returned", ""
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return type(exc).__name__, str(exc)


def _good_buffer_args() -> dict:
    return dict(num_nvl_bytes=nvl_bytes(), num_rdma_bytes=rdma_bytes(), low_latency_mode=True, timeout_s=TIMEOUT_S)


# Buffer(...) arguments one rank spoils: name -> (its arguments over the good ones, its environment,
# exception type, text its message must contain).
BAD_CONSTRUCTIONS = {
    "num_nvl_bytes negative": (dict(num_nvl_bytes=-1), {}, ValueError, "num_nvl_bytes: expected an int >= 0"),
    "num_rdma_bytes a float": (dict(num_rdma_bytes=1e6), {}, TypeError, "num_rdma_bytes: expected an int"),
    "num_qps_per_rank 0": (dict(num_qps_per_rank=0), {}, ValueError, "num_qps_per_rank: expected an int >= 1"),
    "num_arena_bytes negative": (dict(num_arena_bytes=-1), {}, ValueError, "num_arena_bytes: expected an int >= 0"),
    "timeout_s 0": (dict(timeout_s=0), {}, ValueError, "timeout_s: expected a positive, finite number"),
    "low_latency_mode an int": (dict(low_latency_mode=1), {}, TypeError, "low_latency_mode: expected a bool"),
    "enable_shrink": (dict(enable_shrink=True), {}, NotImplementedError, "enable_shrink: moe_ep has no shrink mode"),
    "ranks_per_node not dividing": (dict(ranks_per_node=3), {}, ValueError, "ranks_per_node: must divide the group"),
    "ranks_per_node 0": (dict(ranks_per_node=0), {}, ValueError, "ranks_per_node: expected an int >= 1"),
    "MOE_EP_TIMEOUT_S": (dict(timeout_s=None), {"MOE_EP_TIMEOUT_S": "soon"}, ValueError,
                         "MOE_EP_TIMEOUT_S: expected a number of seconds"),
    "MOE_EP_RANKS_PER_NODE": (dict(ranks_per_node=None), {"MOE_EP_RANKS_PER_NODE": "two"}, ValueError,
                              "MOE_EP_RANKS_PER_NODE: expected a positive integer"),
    "MOE_EP_BACKEND": ({}, {"MOE_EP_BACKEND": "fastest"}, ValueError, "MOE_EP_BACKEND: expected one of"),
}


def bad_construction_on_one_rank(bad_rank: int, explicit_ranks_per_node: bool):
    """Per case of BAD_CONSTRUCTIONS: (what Buffer(...) raised on this rank, the valid round on a new
    Buffer afterwards). explicit_ranks_per_node: the good ranks pass ranks_per_node (no host names needed)."""
    rank = dist.get_rank()
    results = {}
    for name, (spoiled, env, _, _) in BAD_CONSTRUCTIONS.items():
        args = _good_buffer_args()
        if explicit_ranks_per_node:
            args["ranks_per_node"] = dist.get_world_size()
        if rank == bad_rank:
            args.update(spoiled)
            made = _outcome(lambda: with_env(env, Buffer, dist.group.WORLD, **args))
        else:
            made = _outcome(lambda: Buffer(dist.group.WORLD, **args))
        results[name] = (made, _outcome(lambda: valid_round(make_buffer())))
    return results


# Valid Buffer(...) arguments on which one rank differs from the others: name -> (the good ranks'
# arguments over the defaults, the odd rank's).
DISAGREEMENTS = {
    "ranks_per_node": (dict(ranks_per_node=None), dict(ranks_per_node=1)),
    "ranks_per_node given": (dict(ranks_per_node=None), dict(ranks_per_node="world")),  # agrees: the host count
    "num_nvl_bytes": ({}, dict(num_nvl_bytes="twice")),
    "num_rdma_bytes": ({}, dict(num_rdma_bytes="twice")),
    "num_arena_bytes": ({}, dict(num_arena_bytes=0)),
    "low_latency_mode": (dict(low_latency_mode=False, num_rdma_bytes=0), dict(low_latency_mode=True, num_rdma_bytes=0)),
}


def construction_disagreements(odd_rank: int):
    """Per case of DISAGREEMENTS: (what Buffer(...) raised on this rank, the valid round afterwards)."""
    rank = dist.get_rank()
    results = {}
    for name, (good, odd) in DISAGREEMENTS.items():
        args = _good_buffer_args()
        args.update(odd if rank == odd_rank else good)
        for key, value in args.items():
            if value == "twice":
                args[key] = 2 * _good_buffer_args()[key]
            elif value == "world":
                args[key] = dist.get_world_size()
        results[name] = (_outcome(lambda: Buffer(dist.group.WORLD, **args)),
                         _outcome(lambda: valid_round(make_buffer())))
    return results


def construction_missed(missing_rank: int, group_type_error: bool = False):
    """missing_rank comes to a Buffer's construction after the others gave up on it (or, with
    group_type_error, passes a group that is not one and so never comes): (what its construction raised
    on this rank, the valid round on a Buffer made afterwards)."""
    rank = dist.get_rank()
    if rank == missing_rank:
        time.sleep(TIMEOUT_S + 1.5)
        made = _outcome(lambda: Buffer("world" if group_type_error else dist.group.WORLD, **_good_buffer_args()))
    else:
        made = _outcome(lambda: Buffer(dist.group.WORLD, **_good_buffer_args()))
    return made, _outcome(lambda: valid_round(make_buffer(timeout_s=3 * TIMEOUT_S)))


def late_to_a_call(late_rank: int):
    """late_rank comes to a dispatch after the others gave up on it: (what the dispatch raised on this
    rank, what a later call of the same Buffer raised, the valid round on a new Buffer)."""
    rank = dist.get_rank()
    buffer = make_buffer()
    valid_round(buffer)
    x, idx, w = inputs()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts())
    if rank == late_rank:
        time.sleep(TIMEOUT_S + 1.5)
    late = _outcome(lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w))
    later = _outcome(lambda: buffer.get_dispatch_layout(idx, num_experts()))
    return late, later, _outcome(lambda: valid_round(make_buffer(timeout_s=3 * TIMEOUT_S)))


def different_calls_then_more(odd_rank: int):
    """odd_rank runs a low-latency dispatch where the others dispatch: (what each call raised, what a
    later call of the same Buffer raised, the valid round on a new Buffer)."""
    buffer = make_buffer()
    x, idx, w = inputs()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts())
    if dist.get_rank() == odd_rank:
        first = _outcome(lambda: buffer.low_latency_dispatch(x, idx, MAX_TOKENS, num_experts(), use_fp8=False))
    else:
        first = _outcome(lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w))
    later = _outcome(lambda: valid_round(buffer))
    return first, later, _outcome(lambda: valid_round(make_buffer()))


# ---------------------------------------------------------------- one rank spoils a call's arguments
class Call:
    """A valid call's arguments on this rank, which a case spoils on the bad rank only."""

    def __init__(self, buffer: Buffer):
        self.buffer = buffer
        self.x, self.idx, self.w = inputs()
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(self.idx, num_experts())
        self.layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    def dispatch(self, **override):
        kwargs = dict(self.layout, topk_idx=self.idx, topk_weights=self.w)
        kwargs.update(override)
        x = kwargs.pop("x", self.x)
        return self.buffer.dispatch(x, **kwargs)

    def marked(self, token: int, rank: int, value: bool) -> dict:
        """is_token_in_rank with one entry set, and num_tokens_per_rank to match it (so that only
        topk_idx contradicts the layout)."""
        in_rank = self.layout["is_token_in_rank"].clone()
        in_rank[token, rank] = value
        return dict(is_token_in_rank=in_rank, num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32))

    def unheld_rank(self, token: int) -> int:
        """A rank that holds none of the token's experts (with 2 of 3 experts per rank chosen, one exists
        from 3 ranks up)."""
        held = {int(e) // experts_per_rank() for e in self.idx[token] if e >= 0}
        return next(r for r in range(dist.get_world_size()) if r not in held)

    def held_rank(self, token: int) -> int:
        return int(self.idx[token, 0]) // experts_per_rank()

    def combine(self, spoil_rows: bool):
        recv_x, _, _, _, handle, _ = self.dispatch()
        if spoil_rows:
            recv_x = torch.cat([recv_x, recv_x[:1]])
        return self.buffer.combine(recv_x, handle)

    def low_latency(self, topk_idx_for_combine=None, bad_id: bool = False):
        idx = _with_id(self.idx, num_experts()) if bad_id else self.idx
        recv, _, handle, _, _ = self.buffer.low_latency_dispatch(self.x, idx, MAX_TOKENS, num_experts(), use_fp8=False)
        combine_idx = idx if topk_idx_for_combine is None else topk_idx_for_combine(idx)
        return self.buffer.low_latency_combine(recv, combine_idx, self.w, handle)


def _per_expert_off_by_one(c: Call):
    per_expert = c.layout["num_tokens_per_expert"].clone()
    per_expert[int(c.idx[2, 0])] += 1
    return dict(num_tokens_per_expert=per_expert)


def _with_id(idx: torch.Tensor, expert: int) -> torch.Tensor:
    other = idx.clone()
    other[2, 0] = expert
    return other


def _other_topk(idx: torch.Tensor) -> torch.Tensor:
    return _with_id(idx, -1)


def _huge_worst_tokens() -> int:
    """A num_worst_tokens whose x rows alone outgrow this machine's memory (and fit an int32)."""
    with open("/proc/meminfo") as f:
        kib = sum(int(line.split()[1]) for line in f if line.startswith(("MemTotal:", "SwapTotal:")))
    return min(2**31 - 1, 4 * kib * 1024 // (HIDDEN * 2) + 1)


# name -> (exception type, text its message must contain, the call: f(Call, spoiled: bool))
BAD_CALLS = {
    "num_tokens_per_expert counts": (
        ValueError, "num_tokens_per_expert: disagrees with topk_idx",
        lambda c, bad: c.dispatch(**(_per_expert_off_by_one(c) if bad else {}))),
    "num_tokens_per_expert length not a multiple": (
        ValueError, "num_tokens_per_expert: must be a multiple of the group size",
        lambda c, bad: c.dispatch(**(dict(num_tokens_per_expert=torch.zeros(num_experts() + 1, dtype=torch.int32))
                                     if bad else {}))),
    "num_tokens_per_expert length of other experts": (
        ValueError, "that num_tokens_per_expert counts",
        lambda c, bad: c.dispatch(**(dict(num_tokens_per_expert=torch.cat(
            [c.layout["num_tokens_per_expert"], torch.zeros(dist.get_world_size(), dtype=torch.int32)]))
            if bad else {}))),
    "num_tokens_per_rank": (
        ValueError, "num_tokens_per_rank: disagrees with is_token_in_rank",
        lambda c, bad: c.dispatch(**(dict(num_tokens_per_rank=c.layout["num_tokens_per_rank"] + 1) if bad else {}))),
    "num_tokens_per_rdma_rank": (
        ValueError, "num_tokens_per_rdma_rank: disagrees with is_token_in_rank",
        lambda c, bad: c.dispatch(**(dict(num_tokens_per_rdma_rank=torch.full((1,), 99, dtype=torch.int32))
                                     if bad else {}))),
    "is_token_in_rank marks a rank without the token's experts": (
        ValueError, "is_token_in_rank: disagrees with topk_idx (token 2 is marked for rank",
        lambda c, bad: c.dispatch(**(c.marked(2, c.unheld_rank(2), True) if bad else {}))),
    "is_token_in_rank marks a token without experts": (
        ValueError, "is_token_in_rank: disagrees with topk_idx (token 0 is marked for rank 0, but topk_idx sends it "
                    "to no expert",
        lambda c, bad: c.dispatch(**(c.marked(0, 0, True) if bad else {}))),
    "is_token_in_rank misses a rank with the token's expert": (
        ValueError, "is_token_in_rank: disagrees with topk_idx (token 2 is not marked for rank",
        lambda c, bad: c.dispatch(**(c.marked(2, c.held_rank(2), False) if bad else {}))),
    "expert id out of range": (
        ValueError, "topk_idx: expert ids must be -1 or in",
        lambda c, bad: c.dispatch(**(dict(topk_idx=_with_id(c.idx, num_experts())) if bad else {}))),
    "topk_idx on the meta device": (
        ValueError, "topk_idx: expected a tensor with data, got one on the meta device",
        lambda c, bad: c.dispatch(**(dict(topk_idx=c.idx.to("meta")) if bad else {}))),
    "x on the meta device": (
        ValueError, "x: expected a tensor with data, got one on the meta device",
        lambda c, bad: c.dispatch(**(dict(x=c.x.to("meta")) if bad else {}))),
    "num_worst_tokens 2**40": (
        ValueError, "num_worst_tokens: expected at most 2147483647",
        lambda c, bad: c.dispatch(num_worst_tokens=2**40 if bad else NUM_TOKENS * dist.get_world_size())),
    "num_worst_tokens past memory": (
        ValueError, "cannot allocate the receive tensors",
        lambda c, bad: c.dispatch(num_worst_tokens=_huge_worst_tokens() if bad
                                  else NUM_TOKENS * dist.get_world_size())),
    "combine rows": (ValueError, "x: expected shape", lambda c, bad: c.combine(bad)),
    "low-latency expert id": (ValueError, "topk_idx: expert ids must be -1 or in",
                              lambda c, bad: c.low_latency(bad_id=bad)),
    "low-latency combine with another topk_idx": (
        ValueError, "topk_idx: differs from the topk_idx given to this handle's low_latency_dispatch",
        lambda c, bad: c.low_latency(_other_topk if bad else None)),
}


def bad_call_on_one_rank(bad_rank: int, names):
    """Per case of BAD_CALLS named: (what the call raised on this rank, the valid round on the same
    Buffer afterwards)."""
    buffer = make_buffer()
    results = {}
    for name in names:
        call = BAD_CALLS[name][2]
        results[name] = (_outcome(lambda: call(Call(buffer), dist.get_rank() == bad_rank)),
                         _outcome(lambda: valid_round(buffer)))
    return results


def overcommit_refuses_huge_allocations() -> bool:
    """Whether this machine refuses an allocation larger than its memory at once (overcommit modes 0
    and 2) rather than granting it and failing when it is touched."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() in ("0", "2")
    except OSError:
        return False



def construction_with_other_configs(odd_rank: int):
    """odd_rank alone has another default SM budget (as a config cache on its host alone would give it):
    (what Buffer(...) raised on this rank, the valid round afterwards with the budgets alike again)."""
    default = Buffer.num_sms
    if dist.get_rank() == odd_rank:
        Buffer.set_num_sms(default + 2)
    try:
        made = _outcome(lambda: Buffer(dist.group.WORLD, **_good_buffer_args()))
    finally:
        Buffer.set_num_sms(default)
    return made, _outcome(lambda: valid_round(make_buffer()))
