"""CUDA kernels against the portable backend, bit for bit (skipped where no GPU or extension)."""
import pytest
import torch

from moe_ep import _native, fp8
from moe_ep.backends.portable import dispatch_layout

from . import rank_fns
from .problems import Problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not _native.has_kernels(), reason=str(_native.unavailable_reason())),
]


def _random_topk(g, num_tokens, num_topk, num_experts, drop=0.25):
    scores = torch.rand(num_tokens, num_experts, generator=g)
    idx = scores.topk(num_topk, dim=1).indices if num_tokens else torch.empty(0, num_topk, dtype=torch.int64)
    return torch.where(torch.rand(idx.shape, generator=g) < drop, torch.full_like(idx, -1), idx)


@pytest.mark.parametrize("num_tokens,num_topk,num_experts,num_ranks,ranks_per_node", [
    (0, 8, 256, 8, 8), (1, 1, 8, 2, 2), (4096, 8, 256, 8, 8), (4096, 8, 256, 16, 8), (777, 6, 96, 24, 4),
    (3000, 16, 1024, 64, 8), (513, 4, 12, 3, 1),
    # past one block's worth of tokens (many blocks, zeroed counts), with and without rank masks
    (20000, 8, 256, 8, 4), (9000, 6, 160, 80, 8),
])
def test_layout_kernel_equals_portable(seed, num_tokens, num_topk, num_experts, num_ranks, ranks_per_node):
    g = torch.Generator().manual_seed(seed)
    idx = _random_topk(g, num_tokens, num_topk, num_experts)
    want = dispatch_layout(idx, num_experts, num_ranks, ranks_per_node)
    got = _native.ops().get_dispatch_layout(idx.cuda(), num_experts, num_ranks, ranks_per_node)
    for name, w, o in zip(("per_rank", "per_node", "per_expert", "in_rank"), want, got):
        if w is None:
            assert o is None, name
        else:
            assert torch.equal(o.cpu(), w), f"seed {seed}: {name}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(0, 128), (1, 128), (5, 640), (4096, 7168)])
@pytest.mark.parametrize("mode", ["plain", "round_scale", "ue8m0"])
def test_fp8_cast_kernel_equals_portable(seed, dtype, shape, mode):
    g = torch.Generator().manual_seed(seed)
    # Rows over six orders of magnitude, all finite in float16 (|x| < 65504).
    row_scale = torch.exp(torch.randn(shape[0], 1, generator=g) * 3).clamp(max=1e4)
    x = (torch.randn(shape, generator=g).clamp(-6, 6) * row_scale).to(dtype)
    if shape[0] > 2:
        x[1, :128] = 0
    round_scale, use_ue8m0 = mode != "plain", mode == "ue8m0"
    want_q, want_s = fp8._cast_reference(x, 128, round_scale, use_ue8m0)
    got_q, got_s = fp8.per_token_cast_to_fp8(x.cuda(), round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8)), f"seed {seed}: values"
    assert torch.equal(got_s.cpu(), want_s), f"seed {seed}: scales"
    for out_dtype in (torch.bfloat16, torch.float32):
        back = _native.ops().fp8_cast_back(got_q, got_s, out_dtype)
        assert torch.equal(back.cpu(), fp8.per_token_cast_back(want_q, want_s, out_dtype=out_dtype))


def test_fp8_cast_of_an_unaligned_view(seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(9, 257, generator=g).to(torch.bfloat16)
    x = base[:, 1:129]   # rows start 2 bytes past 16-byte boundaries
    want = fp8._cast_reference(x, 128, False, False)
    got = fp8.per_token_cast_to_fp8(x.cuda())
    assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_ranks_sharing_a_gpu_match_cpu_ranks(pools, gpu_pools, seed, num_ranks):
    """Layout on the kernel, dispatch/combine on CUDA tensors: the same bits as the CPU ranks."""
    p = Problem(seed, num_ranks, num_ranks * 4, 256, 4, max_tokens=64)
    on_gpu = gpu_pools(num_ranks).run(rank_fns.normal_round, p, use_fp8=True, num_biases=2)
    on_cpu = pools(num_ranks).run(rank_fns.normal_round, p, use_fp8=True, num_biases=2)
    for rank, (g_res, c_res) in enumerate(zip(on_gpu, on_cpu)):
        for i, (a, b) in enumerate(zip(g_res["layout"], c_res["layout"])):
            assert (a is None and b is None) or torch.equal(a, b), f"rank {rank}: layout[{i}]"
        assert torch.equal(g_res["recv_x"][0].view(torch.uint8), c_res["recv_x"][0].view(torch.uint8))
        assert torch.equal(g_res["recv_x"][1], c_res["recv_x"][1])
        assert torch.equal(g_res["combined"], c_res["combined"]), f"rank {rank}: combined"


def test_peers_are_mapped_through_file_descriptors_by_default(gpu_pools, seed):
    """The default ("auto") maps through the virtual-memory API where the GPU can (every H100/H200), and
    "ipc" (peer_memory for the intranode buffers, low_latency_memory for the low-latency ones) through
    CUDA IPC handles."""
    p = Problem(seed, 2, 8, 256, 4, max_tokens=32)
    assert gpu_pools(2).run(rank_fns.mapped_memory_kinds, p) == [("vmm", "vmm")] * 2
    for choices, kinds in ((dict(peer_memory="ipc"), ("ipc", "vmm")), (dict(low_latency_memory="ipc"), ("vmm", "ipc"))):
        assert gpu_pools(2).run(rank_fns.with_choices, choices, rank_fns.mapped_memory_kinds, p) == [kinds] * 2, choices


def test_backend_info_reports_the_kernels(gpu_pools):
    info = gpu_pools(2).run(rank_fns.backend_info)[0]
    assert info["cuda_kernels"] is True
    assert info["sm90"] is True
    assert info["peer_memory_vmm"] is True, "an H100/H200 maps peers' buffers through file descriptors"
    if _native.has_nvshmem():
        assert _native.ops().nvshmem_version().startswith("3."), "the nvidia-nvshmem wheel is NVSHMEM 3"
