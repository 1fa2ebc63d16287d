"""Bad inputs: each case is a call that must raise before any communication, naming the argument."""
from __future__ import annotations

import torch
import torch.distributed as dist

from moe_ep import Buffer, Config, EventOverlap, fp8

from .problems import Problem
from .rank_fns import low_latency_buffer, my_inputs, normal_buffer, normal_round, outcome


class Ctx:
    """Valid objects each case spoils one thing of."""

    def __init__(self, p: Problem):
        self.p = p
        inp = my_inputs(p)
        self.x, self.idx, self.w = inp["x"], inp["topk_idx"], inp["topk_weights"]
        self.buf = normal_buffer(p.hidden)
        self.other = normal_buffer(p.hidden)
        self.small = Buffer(dist.group.WORLD, num_nvl_bytes=1024)
        self.ll = low_latency_buffer(p)
        self.ll_small = Buffer(dist.group.WORLD, 0, 1024, low_latency_mode=True)
        self.layout = self.buf.get_dispatch_layout(self.idx, p.num_experts)[:4]
        self.handle = self.round(self.buf)
        self.other_handle = self.round(self.other)
        self.ll_handle = self.ll.low_latency_dispatch(self.x, self.idx, p.max_tokens, p.num_experts)[2]

    def layout_kwargs(self, **override):
        per_rank, _, per_expert, in_rank = self.layout
        kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=self.idx, topk_weights=self.w)
        kw.update(override)
        return kw

    def round(self, buffer: Buffer):
        """A valid dispatch and combine; returns the handle."""
        recv_x, _, _, _, handle, _ = buffer.dispatch(self.x, **self.layout_kwargs())
        buffer.combine(recv_x, handle)
        return handle

    def ll_round(self):
        recv, _, handle, _, _ = self.ll.low_latency_dispatch(self.x, self.idx, self.p.max_tokens, self.p.num_experts,
                                                             use_fp8=False)
        self.ll.low_latency_combine(recv, self.idx, self.w, handle)


def _bad_id(c: Ctx, value: int):
    idx = c.idx.clone()
    if idx.numel():
        idx[0, 0] = value
    else:  # a zero-token rank still gets a bad id in a one-row tensor
        idx = torch.full((1, c.p.num_topk), value, dtype=torch.int64)
    return idx


def _x_one_row_short(c: Ctx):
    """A dispatch whose x has 2 rows and whose layout (is_token_in_rank, topk_idx) has 3."""
    idx = torch.full((3, c.p.num_topk), -1, dtype=torch.int64, device=c.x.device)
    per_rank, _, per_expert, in_rank, _ = c.buf.get_dispatch_layout(idx, c.p.num_experts)
    x = torch.zeros(2, c.p.hidden, dtype=torch.bfloat16, device=c.x.device)
    weights = torch.zeros(3, c.p.num_topk, dtype=torch.float32, device=c.x.device)
    return c.buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=idx, topk_weights=weights)


def _ll_x(c: Ctx, rows: int, hidden: int):
    return torch.zeros(rows, hidden, dtype=torch.bfloat16, device=c.x.device)


# (name, exception type, text the message must contain, call)
CASES = [
    ("x dtype", TypeError, "x: expected dtype", lambda c: c.buf.dispatch(c.x.half(), **c.layout_kwargs())),
    ("x rank", ValueError, "x: expected 2 dimensions", lambda c: c.buf.dispatch(c.x[None], **c.layout_kwargs())),
    ("x not a tensor", TypeError, "x: expected a tensor or a pair (x_fp8, scales)", lambda c: c.buf.dispatch([[1.0]], **c.layout_kwargs())),
    ("x sparse", TypeError, "x: expected a dense (strided) tensor, got layout torch.sparse_coo",
     lambda c: c.buf.dispatch(c.x.to_sparse(), **c.layout_kwargs())),
    ("previous_event of no CUDA event", TypeError, "previous_event: expected an EventOverlap of a torch.cuda.Event",
     lambda c: c.buf.dispatch(c.x, previous_event=EventOverlap(event=object()), **c.layout_kwargs())),
    ("layout topk_idx dtype", TypeError, "topk_idx: expected dtype torch.int64",
     lambda c: c.buf.get_dispatch_layout(c.idx.int(), c.p.num_experts)),
    ("num_experts not a multiple of ranks", ValueError, "num_experts: must be a multiple",
     lambda c: c.buf.get_dispatch_layout(c.idx, c.p.num_experts + 1)),
    ("expert id too large", ValueError, "topk_idx: expert ids must be -1 or in",
     lambda c: c.buf.get_dispatch_layout(_bad_id(c, c.p.num_experts), c.p.num_experts)),
    ("expert id below -1", ValueError, "topk_idx: expert ids must be -1 or in",
     lambda c: c.buf.get_dispatch_layout(_bad_id(c, -2), c.p.num_experts)),
    ("is_token_in_rank shape", ValueError, "is_token_in_rank: expected shape",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(is_token_in_rank=c.layout[3][:, :1]))),
    ("x one row short of the layout", ValueError, "x: expected 3 rows, one per row of is_token_in_rank / topk_idx, got 2",
     _x_one_row_short),
    ("is_token_in_rank one row more than x and topk_idx", ValueError, "is_token_in_rank: expected shape",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(is_token_in_rank=torch.cat(
         [c.layout[3], torch.zeros(1, c.p.num_ranks, dtype=torch.bool, device=c.x.device)])))),
    ("num_tokens_per_rank dtype", TypeError, "num_tokens_per_rank: expected dtype torch.int32",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(num_tokens_per_rank=c.layout[0].long()))),
    ("num_tokens_per_rank inconsistent", ValueError, "num_tokens_per_rank: disagrees with is_token_in_rank",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(num_tokens_per_rank=c.layout[0] + 1))),
    ("layout missing", ValueError, "is_token_in_rank: required when no handle",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(is_token_in_rank=None))),
    ("weights without ids", ValueError, "topk_idx, topk_weights: pass both or neither",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(topk_idx=None))),
    ("weights dtype", TypeError, "topk_weights: expected dtype torch.float32",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(topk_weights=c.w.half()))),
    ("top-k too large", ValueError, "topk_idx: top-k must be in",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(topk_idx=c.idx.repeat(1, 20), topk_weights=c.w.repeat(1, 20)))),
    ("fp8 hidden not multiple of 128", ValueError, "x[0]: fp8 hidden size must be a multiple of 128",
     lambda c: c.buf.dispatch((c.x[:, :64].to(torch.float8_e4m3fn), c.w[:, :0]), **c.layout_kwargs())),
    ("fp8 scales shape", ValueError, "x[1]: expected shape",
     lambda c: c.buf.dispatch((c.x.to(torch.float8_e4m3fn), torch.ones(c.x.shape[0], 1)), **c.layout_kwargs())),
    ("expert_alignment", ValueError, "expert_alignment: expected an int >= 1",
     lambda c: c.buf.dispatch(c.x, expert_alignment=0, **c.layout_kwargs())),
    ("num_worst_tokens", ValueError, "num_worst_tokens: expected an int >= 0",
     lambda c: c.buf.dispatch(c.x, num_worst_tokens=-1, **c.layout_kwargs())),
    ("config type", TypeError, "config: expected a moe_ep.Config",
     lambda c: c.buf.dispatch(c.x, config={"num_sms": 20}, **c.layout_kwargs())),
    ("nvl buffer too small", ValueError, "num_nvl_bytes=1024 is too small for dispatch",
     lambda c: c.small.dispatch(c.x, **c.layout_kwargs())),
    ("nvl buffer too small for the default config", ValueError,
     "without config= the dispatch uses Buffer.get_dispatch_config(", lambda c: c.small.dispatch(c.x, **c.layout_kwargs())),
    ("nvl buffer too small for a given config", ValueError, "(Config.get_nvl_buffer_size_hint)",
     lambda c: c.small.dispatch(c.x, config=Config(), **c.layout_kwargs())),
    ("allocate_on_comm_stream alone", ValueError, "allocate_on_comm_stream=True needs previous_event",
     lambda c: c.buf.dispatch(c.x, allocate_on_comm_stream=True, **c.layout_kwargs())),
    ("previous_event type", TypeError, "previous_event: expected an EventOverlap",
     lambda c: c.buf.dispatch(c.x, previous_event=object(), **c.layout_kwargs())),
    ("cached dispatch with top-k", ValueError, "topk_idx: must be None for a cached dispatch",
     lambda c: c.buf.dispatch(c.x, handle=c.handle, topk_idx=c.idx)),
    ("cached dispatch with other tokens", ValueError, "x: the handle's layout is for",
     lambda c: c.buf.dispatch(torch.cat([c.x, c.x[:1] if c.x.shape[0] else torch.zeros(1, c.p.hidden,
                              dtype=c.x.dtype)]), handle=c.handle)),
    ("foreign handle", ValueError, "handle: it was made by another Buffer",
     lambda c: c.buf.combine(torch.zeros(c.other_handle.num_recv_rows, c.p.hidden, dtype=torch.bfloat16),
                             c.other_handle)),
    ("handle type", TypeError, "handle: expected the handle returned by dispatch",
     lambda c: c.buf.combine(c.x, handle=(1, 2, 3))),
    ("combine rows", ValueError, "x: expected shape",
     lambda c: c.buf.combine(torch.zeros(c.handle.num_recv_rows + 1, c.p.hidden, dtype=torch.bfloat16), c.handle)),
    ("bias shape", ValueError, "bias[0]: expected shape",
     lambda c: c.buf.combine(torch.zeros(c.handle.num_recv_rows, c.p.hidden, dtype=torch.bfloat16), c.handle,
                             bias=torch.zeros(c.handle.num_tokens + 1, c.p.hidden, dtype=torch.bfloat16))),
    ("three biases", ValueError, "bias: expected None, one tensor or two",
     lambda c: c.buf.combine(torch.zeros(c.handle.num_recv_rows, c.p.hidden, dtype=torch.bfloat16), c.handle,
                             bias=(c.x, c.x, c.x))),
    ("low-latency on a normal buffer", RuntimeError, "low_latency_dispatch needs a Buffer created with low_latency_mode",
     lambda c: c.buf.low_latency_dispatch(c.x, c.idx, c.p.max_tokens, c.p.num_experts)),
    ("rdma buffer too small", ValueError, "num_rdma_bytes=1024 is too small for low_latency_dispatch",
     lambda c: c.ll_small.low_latency_dispatch(c.x, c.idx, c.p.max_tokens, c.p.num_experts)),
    ("too many tokens", ValueError, "exceed num_max_dispatch_tokens_per_rank",
     lambda c: c.ll.low_latency_dispatch(_ll_x(c, c.p.max_tokens + 1, c.p.hidden),
                                         torch.zeros(c.p.max_tokens + 1, 1, dtype=torch.int64), c.p.max_tokens,
                                         c.p.num_experts)),
    ("low-latency fp8 hidden", ValueError, "x: hidden must be a multiple of 128 for fp8 dispatch",
     lambda c: c.ll.low_latency_dispatch(_ll_x(c, 1, 64), torch.zeros(1, 1, dtype=torch.int64), c.p.max_tokens,
                                         c.p.num_experts)),
    ("ue8m0 without round_scale", ValueError, "use_ue8m0=True needs use_fp8=True and round_scale=True",
     lambda c: c.ll.low_latency_dispatch(c.x, c.idx, c.p.max_tokens, c.p.num_experts, use_ue8m0=True)),
    ("low-latency expert twice", ValueError, "topk_idx: token 0 lists an expert more than once ([1, -1, 1])",
     lambda c: c.ll.low_latency_dispatch(_ll_x(c, 1, c.p.hidden), torch.tensor([[1, -1, 1]], device=c.x.device),
                                         c.p.max_tokens, c.p.num_experts)),
    ("low-latency expert id", ValueError, "topk_idx: expert ids must be -1 or in",
     lambda c: c.ll.low_latency_dispatch(_ll_x(c, 1, c.p.hidden), _bad_id(c, c.p.num_experts)[:1], c.p.max_tokens,
                                         c.p.num_experts)),
    ("stats shape", ValueError, "cumulative_local_expert_recv_stats: expected shape",
     lambda c: c.ll.low_latency_dispatch(c.x, c.idx, c.p.max_tokens, c.p.num_experts,
                                         cumulative_local_expert_recv_stats=torch.zeros(1000, dtype=torch.int32))),
    ("low-latency combine weights", ValueError, "topk_weights: expected shape",
     lambda c: c.ll.low_latency_combine(
         torch.zeros(c.p.local_experts, c.p.num_ranks * c.p.max_tokens, c.p.hidden, dtype=torch.bfloat16),
         c.idx, c.w[:, :1], c.ll_handle)),
    ("low-latency combine x", ValueError, "x: expected shape",
     lambda c: c.ll.low_latency_combine(torch.zeros(1, 1, c.p.hidden, dtype=torch.bfloat16), c.idx, c.w,
                                        c.ll_handle)),
    ("normal handle to low-latency combine", TypeError, "handle: expected the handle returned by low_latency_dispatch",
     lambda c: c.ll.low_latency_combine(c.x, c.idx, c.w, c.handle)),
    ("set_num_sms odd", ValueError, "new_num_sms: expected a multiple of 2", lambda c: Buffer.set_num_sms(7)),
    ("Config chunks", ValueError, "num_max_nvl_chunked_send_tokens must be smaller",
     lambda c: Config(20, 300, 256)),
    ("group type", TypeError, "group: expected a torch.distributed ProcessGroup", lambda c: Buffer("world")),
    ("num_arena_bytes type", TypeError, "num_arena_bytes: expected an int, got float",
     lambda c: Buffer(dist.group.WORLD, 1024, num_arena_bytes=1e6)),
    ("num_arena_bytes negative", ValueError, "num_arena_bytes: expected an int >= 0, got -1",
     lambda c: Buffer(dist.group.WORLD, 1024, num_arena_bytes=-1)),
    ("timeout_s", ValueError, "timeout_s: expected a number of seconds from 0.001 to 2.14748e+06, got 0",
     lambda c: Buffer(dist.group.WORLD, 1024, timeout_s=0)),
    # The store's wait of 0 ms has no deadline, and a wait in milliseconds must fit 32 bits.
    ("timeout_s under a millisecond", ValueError, "timeout_s: expected a number of seconds from 0.001",
     lambda c: Buffer(dist.group.WORLD, 1024, timeout_s=0.0005)),
    ("timeout_s past 32-bit milliseconds", ValueError, "timeout_s: expected a number of seconds from 0.001",
     lambda c: Buffer(dist.group.WORLD, 1024, timeout_s=1e15)),
    ("cast-back hidden", ValueError, "x_fp8: the last dimension must be a multiple of block=128",
     lambda c: fp8.per_token_cast_back(torch.zeros(2, 100, dtype=torch.float8_e4m3fn), torch.ones(2, 1))),
    ("num_experts past 32 bits", ValueError, "num_experts: expected at most 2147483647",
     lambda c: c.buf.get_dispatch_layout(c.idx, 2**62)),
    ("low-latency num_experts past 32 bits", ValueError, "num_experts: expected at most 2147483647",
     lambda c: c.ll.low_latency_dispatch(c.x, c.idx, c.p.max_tokens, 2**62)),
    ("layout topk_idx on the meta device", ValueError, "topk_idx: expected a tensor with data, got one on the meta",
     lambda c: c.buf.get_dispatch_layout(c.idx.to("meta"), c.p.num_experts)),
    ("dispatch topk_idx on the meta device", ValueError, "topk_idx: expected a tensor with data",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(topk_idx=c.idx.to("meta")))),
    ("num_worst_tokens past 32 bits", ValueError, "num_worst_tokens: expected at most 2147483647",
     lambda c: c.buf.dispatch(c.x, num_worst_tokens=2**40, **c.layout_kwargs())),
    ("num_tokens_per_expert length", ValueError, "num_tokens_per_expert: must be a multiple of the group size",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(num_tokens_per_expert=torch.zeros(
         c.p.num_experts + 1, dtype=torch.int32)))),
    ("num_tokens_per_expert counts", ValueError, "num_tokens_per_expert: disagrees with topk_idx (expert 0",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(num_tokens_per_expert=c.layout[2] + torch.arange(
         c.p.num_experts, dtype=torch.int32).eq(0).int()))),
    ("num_tokens_per_expert negative without top-k", ValueError,
     "num_tokens_per_expert: expert 0 counts -1 tokens, expected 0 to the",
     lambda c: c.buf.dispatch(c.x, **c.layout_kwargs(topk_idx=None, topk_weights=None, num_tokens_per_expert=c.layout[2]
                                                     - torch.arange(c.p.num_experts, dtype=torch.int32).eq(0).int()
                                                     * (c.layout[2][0] + 1)))),
    ("EventOverlap wait on wrong object", TypeError, "previous_event: expected an EventOverlap",
     lambda c: c.buf.get_dispatch_layout(c.idx, c.p.num_experts, previous_event="event")),
    # Stride-0 views: rows that cost no memory, more of them than 32-bit counts hold.
    ("x past 32-bit rows", ValueError, "x: expected at most 2147483647 rows",
     lambda c: c.buf.dispatch(_ll_x(c, 1, c.p.hidden).expand(2**31, -1), **c.layout_kwargs())),
    ("layout topk_idx past 32-bit rows", ValueError, "topk_idx: expected at most 2147483647 rows",
     lambda c: c.buf.get_dispatch_layout(torch.zeros(1, c.p.num_topk, dtype=torch.int64).expand(2**31, -1),
                                         c.p.num_experts)),
]


def run_cases(p: Problem):
    """Runs every case on this rank; after each, a valid round proves the Buffer still works."""
    c = Ctx(p)
    outcomes = []
    for name, exc_type, text, call in CASES:
        try:
            call(c)
            outcome = (name, "no exception", "")
        except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
            outcome = (name, type(exc).__name__, str(exc))
        outcomes.append(outcome)
        c.round(c.buf)
        c.ll_round()
    assert isinstance(EventOverlap(), EventOverlap)
    return outcomes


def unknown_argument_on_one_rank(p: Problem, bad_rank: int):
    """Buffer() with a misspelt keyword on bad_rank and the right one on the others, then a Buffer and a
    round on every rank -> (what the first construction raised, the shape of the round's combined x)."""
    name = "num_nvl_byte" if dist.get_rank() == bad_rank else "num_nvl_bytes"
    made = outcome(lambda: Buffer(dist.group.WORLD, **{name: 1 << 20}))
    return made, tuple(normal_round(p)["combined"].shape)


# Stride-0 rows of x whose full copy no machine can hold (2**22 rows of 2**26 bytes: 2**48 bytes, past a
# 47-bit address space), of which a rank sends a few.
HUGE_TOKENS, HUGE_HIDDEN = 2**22, 2**25


def _huge_x() -> torch.Tensor:
    return torch.ones(1, HUGE_HIDDEN, dtype=torch.bfloat16).expand(HUGE_TOKENS, -1)


def _huge_dispatch(buffer: Buffer, is_token_in_rank: torch.Tensor):
    num_ranks = dist.get_world_size()
    return buffer.dispatch(_huge_x(), num_tokens_per_rank=is_token_in_rank.sum(0, dtype=torch.int32),
                           is_token_in_rank=is_token_in_rank,
                           num_tokens_per_expert=torch.zeros(num_ranks, dtype=torch.int32))


def a_few_rows_of_a_huge_x():
    """Each rank sends its token 0 of a stride-0 x to the next rank -> the rows received (their count, whether
    each equals x's row)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    in_rank = torch.zeros(HUGE_TOKENS, num_ranks, dtype=torch.bool)
    in_rank[0, (rank + 1) % num_ranks] = True
    recv_x = _huge_dispatch(normal_buffer(HUGE_HIDDEN), in_rank)[0]
    return recv_x.shape[0], bool((recv_x == 1).all())


def more_rows_than_memory_on_one_rank(p: Problem, bad_rank: int):
    """bad_rank dispatches every row of a stride-0 x to every rank (more bytes than memory holds), the
    others a valid dispatch; then a round on the same Buffer -> (what the dispatch raised, the round's
    combined x shape)."""
    buffer = normal_buffer(HUGE_HIDDEN)
    if dist.get_rank() == bad_rank:
        everywhere = torch.ones(1, dist.get_world_size(), dtype=torch.bool).expand(HUGE_TOKENS, -1)
        raised = outcome(lambda: _huge_dispatch(buffer, everywhere))
    else:
        none = torch.zeros(1, dist.get_world_size(), dtype=torch.bool)
        raised = outcome(lambda: _huge_dispatch(buffer, none.expand(HUGE_TOKENS, -1)))
    return raised, tuple(normal_round(p, buffer=buffer)["combined"].shape)
