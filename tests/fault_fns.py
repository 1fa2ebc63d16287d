"""Rank functions of tests/test_faults.py: one rank spoils a call (or misses it, or comes late) while the
others make it as they should; each returns what every call raised, and whether a valid round on the
same group (and, where the Buffer stays usable, on the same Buffer) then worked."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from moe_ep import Buffer, Config
from moe_ep.fp8 import per_token_cast_to_fp8

from .rank_fns import outcome, with_env

HIDDEN = 128
NUM_TOPK = 2
NUM_TOKENS = 6
MAX_TOKENS = 8  # low-latency tokens per rank
TIMEOUT_S = 4.0  # the peers' deadline in these tests
_device = torch.device("cpu")  # where inputs() puts this rank's tensors (on_cuda: its GPU, for the kernels)


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
    return x.to(_device), idx.to(_device), w.to(_device)


def on_cuda(fn, *args):
    """fn(*args) with this rank's inputs on its GPU, so that the kernels serve the calls."""
    global _device
    _device = torch.device("cuda", torch.cuda.current_device())
    try:
        return fn(*args)
    finally:
        _device = torch.device("cpu")


def valid_round(buffer: Buffer) -> str:
    """Layout, dispatch, combine and a low-latency dispatch and combine, each combine's result checked."""
    x, idx, w = inputs()
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts())
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    combined, _, _ = buffer.combine(recv_x, handle)
    # Each token comes back once from every rank it went to; doubling a bf16 value is exact.
    expected = x.float() * in_rank.sum(1, keepdim=True).float()
    assert torch.equal(combined.float(), expected), "combine returned other values than the tokens sent"
    recv, _, ll_handle, _, _ = buffer.low_latency_dispatch(x, idx, MAX_TOKENS, num_experts(), use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(recv, idx, w, ll_handle)
    assert torch.equal(combined, _weighted_sum(x, idx, w)), "low_latency_combine returned other values than expected"
    return "passed"


def _weighted_sum(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a low-latency combine of the dispatched rows returns, in the portable backend's order of operations."""
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(idx.shape[1]):
        acc = torch.where(idx[:, k : k + 1] >= 0, acc + w[:, k : k + 1] * x.float(), acc)
    return acc.to(torch.bfloat16)


def _good_buffer_args() -> dict:
    return dict(num_nvl_bytes=nvl_bytes(), num_rdma_bytes=rdma_bytes(), low_latency_mode=True, timeout_s=TIMEOUT_S)


# Buffer(...) arguments one rank spoils: name -> (its arguments over the good ones, its environment,
# exception type, text its message must contain).
BAD_CONSTRUCTIONS = {
    "num_nvl_bytes negative": (dict(num_nvl_bytes=-1), {}, ValueError, "num_nvl_bytes: expected an int >= 0"),
    "num_rdma_bytes a float": (dict(num_rdma_bytes=1e6), {}, TypeError, "num_rdma_bytes: expected an int"),
    "num_qps_per_rank 0": (dict(num_qps_per_rank=0), {}, ValueError, "num_qps_per_rank: expected an int >= 1"),
    "num_arena_bytes negative": (dict(num_arena_bytes=-1), {}, ValueError, "num_arena_bytes: expected an int >= 0"),
    "timeout_s 0": (dict(timeout_s=0), {}, ValueError, "timeout_s: expected a number of seconds from 0.001"),
    "low_latency_mode an int": (dict(low_latency_mode=1), {}, TypeError, "low_latency_mode: expected a bool"),
    "enable_shrink an int": (dict(enable_shrink=1), {}, TypeError, "enable_shrink: expected a bool"),
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
            made = outcome(lambda: with_env(env, Buffer, dist.group.WORLD, **args))
        else:
            made = outcome(lambda: Buffer(dist.group.WORLD, **args))
        results[name] = (made, outcome(lambda: valid_round(make_buffer())))
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
    "MOE_EP_DEBUG": ({}, dict(_env={"MOE_EP_DEBUG": "1"})),  # read at construction: the kernels' gate meetings
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
        env = args.pop("_env", {})
        results[name] = (outcome(lambda: with_env(env, Buffer, dist.group.WORLD, **args)),
                         outcome(lambda: valid_round(make_buffer())))
    return results


def construction_missed(missing_rank: int, group_type_error: bool = False):
    """missing_rank comes to a Buffer's construction after the others gave up on it (or, with
    group_type_error, passes a group that is not one and so never comes): (what its construction raised
    on this rank, the valid round on a Buffer made afterwards)."""
    rank = dist.get_rank()
    if rank == missing_rank:
        time.sleep(TIMEOUT_S + 1.5)
        made = outcome(lambda: Buffer("world" if group_type_error else dist.group.WORLD, **_good_buffer_args()))
    else:
        made = outcome(lambda: Buffer(dist.group.WORLD, **_good_buffer_args()))
    return made, outcome(lambda: valid_round(make_buffer(timeout_s=3 * TIMEOUT_S)))


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
    late = outcome(lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w))
    later = outcome(lambda: buffer.get_dispatch_layout(idx, num_experts()))
    return late, later, outcome(lambda: valid_round(make_buffer(timeout_s=3 * TIMEOUT_S)))


def different_calls_then_more(odd_rank: int):
    """odd_rank runs a low-latency dispatch where the others dispatch: (what each call raised, what a
    later call of the same Buffer raised, the valid round on a new Buffer)."""
    buffer = make_buffer()
    x, idx, w = inputs()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts())
    if dist.get_rank() == odd_rank:
        first = outcome(lambda: buffer.low_latency_dispatch(x, idx, MAX_TOKENS, num_experts(), use_fp8=False))
    else:
        first = outcome(lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w))
    later = outcome(lambda: valid_round(buffer))
    return first, later, outcome(lambda: valid_round(make_buffer()))


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
        results[name] = (outcome(lambda: call(Call(buffer), dist.get_rank() == bad_rank)),
                         outcome(lambda: valid_round(buffer)))
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
        made = outcome(lambda: Buffer(dist.group.WORLD, **_good_buffer_args()))
    finally:
        Buffer.set_num_sms(default)
    return made, outcome(lambda: valid_round(make_buffer()))


# ---------------------------------------------------------------- one rank makes a call in another form
WIDE = 2 * HIDDEN  # the other hidden size a rank tries


def form_buffer() -> Buffer:
    """make_buffer with room for float32 rows of WIDE and for low-latency calls of WIDE and twice the experts."""
    world = dist.get_world_size()
    return make_buffer(num_nvl_bytes=Config().get_nvl_buffer_size_hint(WIDE * 4, world) * 4,
                       num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, WIDE, world, 2 * num_experts()))


class FormCall(Call):
    """A valid call's arguments on this rank, and the calls a case makes on every rank before the one
    the odd rank makes in another form."""

    def layout_for(self, idx: torch.Tensor, experts: int) -> dict:
        per_rank, per_rdma, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx, experts)
        return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=idx)

    def top_1(self) -> dict:
        return dict(self.layout_for(self.idx[:, :1].contiguous(), num_experts()),
                    topk_weights=self.w[:, :1].contiguous())

    def cached(self, handle):
        return self.buffer.dispatch(self.x, handle=handle)

    def dispatches(self, count: int) -> list:
        """(recv_x, recv_topk_weights, handle) of `count` dispatches on every rank."""
        return [(recv_x, recv_w, handle) for recv_x, _, recv_w, _, handle, _ in
                (self.dispatch() for _ in range(count))]

    def low_latency_dispatch(self, **kwargs):
        args = dict(x=self.x, topk_idx=self.idx, num_max_dispatch_tokens_per_rank=MAX_TOKENS,
                    num_experts=num_experts(), use_fp8=False)
        args.update(kwargs)
        return self.buffer.low_latency_dispatch(**args)

    def low_latency_combine(self, dispatched, **kwargs):
        recv, _, handle, _, _ = dispatched
        return self.buffer.low_latency_combine(recv, self.idx, self.w, handle, **kwargs)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x], dim=1)


def _combine_older_handle(c: FormCall, odd: bool):
    (recv0, _, handle0), (recv1, _, handle1) = c.dispatches(2)
    return c.buffer.combine(recv0, handle0) if odd else c.buffer.combine(recv1, handle1)


def _combine_with(c: FormCall, odd: bool, spoil):
    ((recv_x, recv_w, handle),) = c.dispatches(1)
    return c.buffer.combine(*spoil(recv_x, recv_w, handle)) if odd else c.buffer.combine(recv_x, handle)


def _cached_or_fresh(c: FormCall, odd: bool):
    ((_, _, handle),) = c.dispatches(1)
    return c.cached(handle) if odd else c.dispatch()


def _cached_older_handle(c: FormCall, odd: bool):
    (_, _, handle0), (_, _, handle1) = c.dispatches(2)
    return c.cached(handle0 if odd else handle1)


def _low_latency_combine_older_handle(c: FormCall, odd: bool):
    first, second = c.low_latency_dispatch(), c.low_latency_dispatch()
    return c.low_latency_combine(first if odd else second)


def _ll_fp8_flags(**odd_flags):
    """A low-latency dispatch with fp8 on every rank, and odd_flags on the odd rank only."""
    return lambda c, odd: c.low_latency_dispatch(use_fp8=True, **(odd_flags if odd else {}))


# name -> (call, field, the odd rank's phrase, the others', the case: f(FormCall, odd: bool)), each case on a
# new Buffer, so that the meetings' numbers (call #n) are the same in every run. {experts}: num_experts();
# {double}: twice that.
FORM_DISAGREEMENTS = {
    "fp8 x": ("dispatch", "x dtype", "fp8 x", "bf16 x",
              lambda c, odd: c.dispatch(**(dict(x=per_token_cast_to_fp8(c.x)) if odd else {}))),
    "float32 x": ("dispatch", "x dtype", "float32 x", "bf16 x",
                  lambda c, odd: c.dispatch(**(dict(x=c.x.float()) if odd else {}))),
    "hidden": ("dispatch", "hidden", f"hidden {WIDE}", f"hidden {HIDDEN}",
               lambda c, odd: c.dispatch(**(dict(x=_wide(c.x)) if odd else {}))),
    "without top-k": ("dispatch", "top-k", "no top-k", f"top-k {NUM_TOPK}",
                      lambda c, odd: c.dispatch(**(dict(topk_idx=None, topk_weights=None) if odd else {}))),
    "top-k 1": ("dispatch", "top-k", "top-k 1", f"top-k {NUM_TOPK}",
                lambda c, odd: c.dispatch(**(c.top_1() if odd else {}))),
    "experts": ("dispatch", "experts", "{double} experts", "{experts} experts",
                lambda c, odd: c.dispatch(**(c.layout_for(c.idx, 2 * num_experts()) if odd else {}))),
    "num_worst_tokens": ("dispatch", "num_worst_tokens", "num_worst_tokens=64", "num_worst_tokens=0",
                         lambda c, odd: c.dispatch(num_worst_tokens=64 if odd else 0)),
    "cached dispatch beside fresh ones": ("dispatch", "handle", "the handle of the dispatch at call #0", "no handle",
                                          _cached_or_fresh),
    "cached dispatch with an older handle": ("dispatch", "handle", "the handle of the dispatch at call #0",
                                             "the handle of the dispatch at call #1", _cached_older_handle),
    "combine with an older handle": ("combine", "handle", "the handle of the dispatch at call #0",
                                     "the handle of the dispatch at call #1", _combine_older_handle),
    "combine float32 x": ("combine", "x dtype", "float32 x", "bf16 x",
                          lambda c, odd: _combine_with(c, odd, lambda x, w, h: (x.float(), h))),
    "combine hidden": ("combine", "hidden", f"hidden {WIDE}", f"hidden {HIDDEN}",
                       lambda c, odd: _combine_with(c, odd, lambda x, w, h: (_wide(x), h))),
    "combine topk_weights": ("combine", "topk_weights", f"topk_weights of {NUM_TOPK} columns", "no topk_weights",
                             lambda c, odd: _combine_with(c, odd, lambda x, w, h: (x, h, w))),
    "low-latency use_fp8": ("low_latency_dispatch", "use_fp8", "use_fp8=True", "use_fp8=False",
                            lambda c, odd: c.low_latency_dispatch(use_fp8=odd)),
    "low-latency round_scale": ("low_latency_dispatch", "round_scale", "round_scale=True", "round_scale=False",
                                _ll_fp8_flags(round_scale=True)),
    "low-latency use_ue8m0": ("low_latency_dispatch", "use_ue8m0", "use_ue8m0=True", "use_ue8m0=False",
                              lambda c, odd: c.low_latency_dispatch(use_fp8=True, round_scale=True, use_ue8m0=odd)),
    "low-latency return_recv_hook": ("low_latency_dispatch", "return_recv_hook", "return_recv_hook=True",
                                     "return_recv_hook=False",
                                     lambda c, odd: c.low_latency_dispatch(return_recv_hook=odd)),
    "low-latency num_max_dispatch_tokens_per_rank": (
        "low_latency_dispatch", "num_max_dispatch_tokens_per_rank",
        f"num_max_dispatch_tokens_per_rank={NUM_TOKENS}", f"num_max_dispatch_tokens_per_rank={MAX_TOKENS}",
        lambda c, odd: c.low_latency_dispatch(num_max_dispatch_tokens_per_rank=NUM_TOKENS if odd else MAX_TOKENS)),
    "low-latency hidden": ("low_latency_dispatch", "hidden", f"hidden {WIDE}", f"hidden {HIDDEN}",
                           lambda c, odd: c.low_latency_dispatch(x=_wide(c.x) if odd else c.x)),
    "low-latency experts": ("low_latency_dispatch", "experts", "{double} experts", "{experts} experts",
                            lambda c, odd: c.low_latency_dispatch(num_experts=(2 if odd else 1) * num_experts())),
    "low-latency combine with an older handle": (
        "low_latency_combine", "handle", "the handle of the low_latency_dispatch at call #0",
        "the handle of the low_latency_dispatch at call #1", _low_latency_combine_older_handle),
    "low-latency combine return_recv_hook": (
        "low_latency_combine", "return_recv_hook", "return_recv_hook=True", "return_recv_hook=False",
        lambda c, odd: c.low_latency_combine(c.low_latency_dispatch(), return_recv_hook=odd)),
}


def form_disagreements_on_one_rank(odd_rank: int, names):
    """Per case of FORM_DISAGREEMENTS named, on a new Buffer: (what the disputed call raised on this rank,
    the valid round on the same Buffer afterwards)."""
    results = {}
    for name in names:
        case = FORM_DISAGREEMENTS[name][4]
        buffer = form_buffer()
        results[name] = (outcome(lambda: case(FormCall(buffer), dist.get_rank() == odd_rank)),
                         outcome(lambda: valid_round(buffer)))
    return results


def _low_latency_call_with_a_hook_pending(c: FormCall, odd: bool, combine: bool):
    """Every rank dispatches with the hook; the odd rank leaves its hook pending and makes the next call (a
    dispatch, or with combine the dispatch's combine), which the kernels refuse; it runs the hook after."""
    dispatched = c.low_latency_dispatch(return_recv_hook=True)
    hook = dispatched[4]
    if not odd:
        hook()
    try:
        return c.low_latency_combine(dispatched) if combine else c.low_latency_dispatch()
    finally:
        if odd:
            hook()


def _dispatch_captured_without_worst_tokens(c: FormCall, odd: bool):
    """The odd rank captures its dispatch in a CUDA graph without num_worst_tokens, which the kernels refuse."""
    if not odd:
        return c.dispatch()
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        return c.dispatch()


# What only the kernels refuse, on one rank: name -> (exception, text, the case: f(FormCall, odd: bool)).
KERNEL_REFUSALS = {
    "low-latency dispatch with a hook pending": (
        RuntimeError, "call the hook of the previous low_latency_dispatch first",
        lambda c, odd: _low_latency_call_with_a_hook_pending(c, odd, combine=False)),
    "low-latency combine with its dispatch's hook pending": (
        RuntimeError, "call the hook of the previous low_latency_dispatch first",
        lambda c, odd: _low_latency_call_with_a_hook_pending(c, odd, combine=True)),
    "dispatch captured without num_worst_tokens": (
        RuntimeError, "capturing it in a CUDA graph needs num_worst_tokens > 0", _dispatch_captured_without_worst_tokens),
}


def kernel_refusals_on_one_rank(odd_rank: int, names):
    """Per case of KERNEL_REFUSALS named, on a new Buffer: (what the call raised on this rank, the valid
    round on the same Buffer afterwards)."""
    results = {}
    for name in names:
        case = KERNEL_REFUSALS[name][2]
        buffer = form_buffer()
        c = FormCall(buffer)
        c.dispatch()  # the kernels' buffers are mapped (collective) before the case
        c.low_latency_dispatch()
        results[name] = (outcome(lambda: case(c, dist.get_rank() == odd_rank)), outcome(lambda: valid_round(buffer)))
    return results


def forms_of_three_values(fp8_rank: int, wide_float_rank: int):
    """fp8_rank dispatches fp8 x, wide_float_rank float32 x of WIDE columns, the others bf16 x: (what the
    dispatch raised on this rank, the valid round on the same Buffer afterwards)."""
    buffer = form_buffer()
    c = FormCall(buffer)
    x = {fp8_rank: per_token_cast_to_fp8(c.x), wide_float_rank: _wide(c.x).float()}.get(dist.get_rank(), c.x)
    return outcome(lambda: c.dispatch(x=x)), outcome(lambda: valid_round(buffer))
