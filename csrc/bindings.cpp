// Python bindings: tensor checks, allocation and streams on top of the torch-free kernels/api.cuh.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/api.cuh"
#include "kernels/buffer_layout.cuh"
#include "low_latency_bindings.h"
#include "peer_memory.h"
#include "runtime_nvshmem.h"
#include "torch_args.h"

#ifndef MOE_EP_NVSHMEM_REASON
#define MOE_EP_NVSHMEM_REASON ""
#endif

namespace moe_ep {
namespace {

// Vector loads in the kernels need 16-byte aligned rows; a view into the middle of a tensor is copied.
torch::Tensor aligned_contiguous(const torch::Tensor& t) {
    auto c = t.contiguous();
    return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

DType dtype_of(const torch::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case torch::kBFloat16: return DType::kBFloat16;
        case torch::kFloat16: return DType::kFloat16;
        case torch::kFloat32: return DType::kFloat32;
        default: TORCH_CHECK(false, name, ": expected bfloat16, float16 or float32, got ", t.scalar_type());
    }
}

py::tuple get_dispatch_layout(const torch::Tensor& topk_idx, int64_t num_experts, int64_t num_ranks,
                              int64_t ranks_per_node) {
    TORCH_CHECK(topk_idx.is_cuda() && topk_idx.scalar_type() == torch::kInt64 && topk_idx.dim() == 2,
                "topk_idx: expected a 2-D int64 CUDA tensor");
    TORCH_CHECK(num_ranks > 0 && num_experts % num_ranks == 0 && ranks_per_node > 0 && num_ranks % ranks_per_node == 0,
                "get_dispatch_layout: inconsistent num_experts/num_ranks/ranks_per_node");
    const c10::cuda::CUDAGuard guard(topk_idx.device());
    auto idx = topk_idx.contiguous();
    const int64_t num_tokens = idx.size(0), num_nodes = num_ranks / ranks_per_node;
    auto opts = idx.options();
    auto counts = torch::empty({num_ranks + num_nodes + num_experts}, opts.dtype(torch::kInt32));
    auto in_rank = torch::empty({num_tokens, num_ranks}, opts.dtype(torch::kBool));
    layout::get_dispatch_layout(idx.data_ptr<int64_t>(), static_cast<int>(num_tokens), static_cast<int>(idx.size(1)),
                                static_cast<int>(num_experts), static_cast<int>(num_ranks),
                                static_cast<int>(ranks_per_node), counts.data_ptr<int>(), in_rank.data_ptr<bool>(),
                                num_sms_of_current_device(), current_stream());
    auto per_rank = counts.narrow(0, 0, num_ranks);
    py::object per_node = py::none();
    if (num_nodes > 1) per_node = py::cast(counts.narrow(0, num_ranks, num_nodes));
    auto per_expert = counts.narrow(0, num_ranks + num_nodes, num_experts);
    return py::make_tuple(per_rank, per_node, per_expert, in_rank);
}

py::tuple fp8_cast(const torch::Tensor& x, bool round_scale, bool use_ue8m0) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "x: expected a 2-D CUDA tensor");
    TORCH_CHECK(x.size(1) % fp8::kBlock == 0, "x: hidden must be a multiple of ", fp8::kBlock, ", got ", x.size(1));
    TORCH_CHECK(!use_ue8m0 || round_scale, "use_ue8m0=True needs round_scale=True");
    const c10::cuda::CUDAGuard guard(x.device());
    auto src = aligned_contiguous(x);
    const int64_t n = src.size(0), hidden = src.size(1), blocks = hidden / fp8::kBlock;
    auto q = torch::empty({n, hidden}, src.options().dtype(torch::kFloat8_e4m3fn));
    torch::Tensor scales = use_ue8m0 ? torch::zeros({n, (blocks + 3) / 4}, src.options().dtype(torch::kInt32))
                                     : torch::empty({n, blocks}, src.options().dtype(torch::kFloat32));
    fp8::per_token_cast(src.data_ptr(), dtype_of(src, "x"), static_cast<int>(n), static_cast<int>(hidden), round_scale,
                        use_ue8m0, static_cast<uint8_t*>(q.data_ptr()), scales.data_ptr(),
                        num_sms_of_current_device(), current_stream());
    return py::make_tuple(q, scales);
}

py::tuple fp8_blockwise_cast(const torch::Tensor& x, bool pow2_scales, double amax_epsilon, double inf_factor) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2, "x: expected a 2-D CUDA tensor");
    TORCH_CHECK(x.size(1) % fp8::kBlock == 0, "x: hidden must be a multiple of ", fp8::kBlock, ", got ", x.size(1));
    const c10::cuda::CUDAGuard guard(x.device());
    auto src = aligned_contiguous(x);
    const int64_t n = src.size(0), hidden = src.size(1);
    auto q = torch::empty({n, hidden}, src.options().dtype(torch::kFloat8_e4m3fn));
    auto scale_inv = torch::empty({n, hidden / fp8::kBlock}, src.options().dtype(torch::kFloat32));
    fp8::blockwise_cast(src.data_ptr(), dtype_of(src, "x"), static_cast<int>(n), static_cast<int>(hidden), pow2_scales,
                        static_cast<float>(amax_epsilon), static_cast<float>(inf_factor),
                        static_cast<uint8_t*>(q.data_ptr()), scale_inv.data_ptr<float>(), num_sms_of_current_device(),
                        current_stream());
    return py::make_tuple(q, scale_inv);
}

torch::Tensor fp8_cast_back(const torch::Tensor& q, const torch::Tensor& scales, torch::ScalarType out_dtype) {
    TORCH_CHECK(q.is_cuda() && q.dim() == 2 && q.scalar_type() == torch::kFloat8_e4m3fn,
                "x_fp8: expected a 2-D float8_e4m3fn CUDA tensor");
    TORCH_CHECK(q.size(1) % fp8::kBlock == 0, "x_fp8: hidden must be a multiple of ", fp8::kBlock);
    const bool ue8m0 = scales.scalar_type() == torch::kInt32;
    TORCH_CHECK(ue8m0 || scales.scalar_type() == torch::kFloat32, "scales: expected float32 or int32 (UE8M0)");
    TORCH_CHECK(out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat32, "out_dtype: bfloat16 or float32");
    const c10::cuda::CUDAGuard guard(q.device());
    auto src = aligned_contiguous(q);
    auto s = scales.contiguous();
    auto out = torch::empty(src.sizes(), src.options().dtype(out_dtype));
    fp8::per_token_cast_back(static_cast<const uint8_t*>(src.data_ptr()), s.data_ptr(), ue8m0,
                             static_cast<int>(src.size(0)), static_cast<int>(src.size(1)), out.data_ptr(),
                             out_dtype == torch::kFloat32 ? DType::kFloat32 : DType::kBFloat16,
                             num_sms_of_current_device(), current_stream());
    return out;
}

void count_low_latency_rows(const torch::Tensor& topk_idx, int64_t experts_per_rank, const torch::Tensor& recv_src_info,
                            const torch::Tensor& recv_count, int64_t num_topk, int64_t max_tokens, bool combine,
                            int64_t row_bytes, const torch::Tensor& acc, const torch::Tensor& expert_last) {
    TORCH_CHECK(topk_idx.is_cuda() && topk_idx.scalar_type() == torch::kInt64 && topk_idx.is_contiguous(),
                "topk_idx: expected a contiguous int64 CUDA tensor");
    TORCH_CHECK(recv_src_info.dim() == 2 && recv_src_info.scalar_type() == torch::kInt32 && recv_src_info.is_contiguous(),
                "recv_src_info: expected a contiguous int32 [local experts, slots] tensor");
    const int64_t num_local = recv_src_info.size(0), slots = recv_src_info.size(1);
    TORCH_CHECK(recv_count.scalar_type() == torch::kInt32 && recv_count.numel() == num_local,
                "recv_count: expected int32 [", num_local, "]");
    TORCH_CHECK(slots % max_tokens == 0, "recv_src_info: slots must be ranks x max_tokens");
    const int64_t num_ranks = slots / max_tokens;
    TORCH_CHECK(acc.scalar_type() == torch::kInt64 && acc.is_contiguous() && acc.numel() >= 2 * num_ranks + num_local,
                "acc: expected a contiguous int64 tensor of at least ", 2 * num_ranks + num_local, " entries");
    TORCH_CHECK(expert_last.scalar_type() == torch::kInt64 && expert_last.is_contiguous() && expert_last.numel() >= num_local,
                "expert_last: expected int64 [", num_local, "]");
    for (const auto* t : {&recv_src_info, &recv_count, &acc, &expert_last})
        TORCH_CHECK(t->device() == topk_idx.device(), "the counters' tensors must be on topk_idx's device");
    const c10::cuda::CUDAGuard guard(topk_idx.device());
    traffic::count_low_latency(topk_idx.data_ptr<int64_t>(), topk_idx.numel(), static_cast<int>(experts_per_rank),
                               recv_src_info.data_ptr<int>(), recv_count.data_ptr<int>(), static_cast<int>(num_local),
                               slots, static_cast<int>(num_topk), static_cast<int>(max_tokens),
                               static_cast<int>(num_ranks), combine, row_bytes, acc.data_ptr<int64_t>(),
                               expert_last.data_ptr<int64_t>(), current_stream());
}

// ------------------------------------------------------------------ intranode buffers (CUDA IPC)
// A buffer is one cudaMalloc allocation (IPC handles name whole allocations), zeroed before any peer
// can see it. Pointers travel to Python as integers; moe_ep/backends/peers.py owns their lifetime.
py::tuple ipc_alloc(int64_t num_bytes) {
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&ptr, num_bytes));
    C10_CUDA_CHECK(cudaMemset(ptr, 0, num_bytes));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    cudaIpcMemHandle_t handle;
    C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, ptr));
    return py::make_tuple(reinterpret_cast<int64_t>(ptr), py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle)));
}

int64_t ipc_open(const std::string& handle_bytes) {
    TORCH_CHECK(handle_bytes.size() == sizeof(cudaIpcMemHandle_t), "ipc_open: not a CUDA IPC handle");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handle_bytes.data(), sizeof(handle));
    void* ptr = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
    return reinterpret_cast<int64_t>(ptr);
}

// The same through the driver's virtual-memory API (peer_memory.h): the allocation travels as a file
// descriptor, which Python passes to the peers; handles and sizes travel as integers.
py::tuple vmm_alloc(int64_t num_bytes) {
    TORCH_CHECK(num_bytes > 0, "vmm_alloc: num_bytes must be positive");
    int fd = -1;
    const auto m = peer_memory::allocate(c10::cuda::current_device(), static_cast<size_t>(num_bytes), &fd);
    return py::make_tuple(static_cast<int64_t>(m.address), static_cast<int64_t>(m.size),
                          static_cast<int64_t>(m.handle), fd);
}

py::tuple vmm_import(int fd, int64_t size) {
    const auto m = peer_memory::import(c10::cuda::current_device(), fd, static_cast<size_t>(size));
    return py::make_tuple(static_cast<int64_t>(m.address), static_cast<int64_t>(m.handle));
}

void vmm_release(int64_t address, int64_t size, int64_t handle) {
    peer_memory::release(
        {static_cast<uint64_t>(address), static_cast<size_t>(size), static_cast<uint64_t>(handle)});
}

// Zeroes device memory and waits (a buffer must be clean before any peer can see it).
void device_zero(int64_t ptr, int64_t num_bytes) {
    C10_CUDA_CHECK(cudaMemset(reinterpret_cast<void*>(ptr), 0, num_bytes));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
}

void ipc_close(int64_t ptr) { C10_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr))); }
void device_free(int64_t ptr) { C10_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr))); }

// Spins (without the GIL) until host_info[index] == value or a kernel reported an error; false after
// timeout_s. host_info is pinned memory the kernels write through its device mapping.
bool wait_host_value(const torch::Tensor& host_info, int64_t index, int64_t value, double timeout_s) {
    TORCH_CHECK(host_info.is_pinned() && host_info.scalar_type() == torch::kInt32, "host_info: pinned int32 expected");
    const volatile int* info = host_info.data_ptr<int>();
    py::gil_scoped_release no_gil;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (uint64_t spins = 0;; ++spins) {
        if (info[index] == value) return true;
        if (info[intranode::kHostError] != 0) return false;
        if ((spins & 1023) == 0) {
            if (std::chrono::steady_clock::now() > deadline) return false;
            if (spins > (1u << 20)) std::this_thread::yield();  // a long wait: let the peers' hosts run
        }
    }
}

struct IntranodeCtx {
    int64_t buffers;  // device int64 [R]: every rank's buffer as mapped here
    int rank, num_ranks;
    int64_t num_nvl_bytes;
    torch::Tensor host_info;
    double timeout_s;
    int ranks_on_device;
    int sm_share_percent = 100;  // set from Python: this process's MPS SM share (backends/intranode.py)
    int64_t wait_ns = 0;  // device uint64 [blocks][kWaitSlots] wait profile, or 0 (set from Python per call)
    int64_t kernel_log = 0;  // device int64 [kernel_log_ints()], or 0 (set from Python with the wait profile)
    bool stream_combine = false;  // set from Python (backends/intranode.py: use_stream_combine)
    // Set from Python, the same on every rank (where any GPU holds several of the group's ranks): the
    // combines and the cached dispatches start behind a rendezvous kernel (intranode/rendezvous.cu), the other
    // dispatches behind their count exchange already.
    bool rendezvous = false;
    // The group's largest count of ranks on one GPU, for fitted_blocks; 0: the data kernels take the SM
    // budget as their block count (fit_blocks off in moe_ep.backends.choices).
    int fit_ranks_on_device = 0;
};

intranode::Ctx make_ctx(const IntranodeCtx& c, int64_t num_blocks) {
    TORCH_CHECK(num_blocks > 0, "num_sms: expected a positive number of blocks");
    intranode::Ctx ctx;
    ctx.buffers = reinterpret_cast<uint8_t* const*>(c.buffers);
    ctx.rank = c.rank;
    ctx.num_ranks = c.num_ranks;
    ctx.num_nvl_bytes = c.num_nvl_bytes;
    ctx.host_info = c.host_info.data_ptr<int>();
    ctx.timeout_ns = static_cast<uint64_t>(c.timeout_s * 1e9);
    ctx.num_blocks = static_cast<int>(num_blocks);
    ctx.ranks_on_device = c.ranks_on_device;
    ctx.sm_share_percent = c.sm_share_percent;
    ctx.wait_ns = reinterpret_cast<uint64_t*>(c.wait_ns);
    ctx.kernel_log = reinterpret_cast<int64_t*>(c.kernel_log);
    ctx.stream_combine = c.stream_combine;
    ctx.full_first = false;
    ctx.rendezvous_before = 0;
    ctx.start_together = c.rendezvous;
    ctx.stream = current_stream();
    return ctx;
}

// The context of a data kernel (dispatch, combine): where ranks share a GPU the SM budget fitted to
// them; and the combines launched in 1024-thread blocks where they fit (2 and 4 ranks on one H200:
// every combine +11-39%; 2 ranks on two H200s: +30-47%; `moe-ep-bench intranode --ranks 2 4 --sms 24
// --modes combine` against `--no-fit-blocks`; the dispatches were level or slower, so they keep the
// 512-thread shapes). With fit_blocks off (moe_ep.backends.choices), the budget and the 512-thread shapes.
// `opens`: the data kernel's KernelId where it needs a rendezvous first (when the ranks share a GPU), 0
// where its call's count exchange already keeps it from starting before every rank reached the call.
intranode::Ctx data_ctx(const IntranodeCtx& c, int64_t num_blocks, bool combine, int opens = 0) {
    intranode::Ctx ctx = make_ctx(c, num_blocks);
    if (c.rendezvous) ctx.rendezvous_before = opens;
    if (c.fit_ranks_on_device > 0) {
        ctx.full_first = combine;
        ctx.num_blocks = intranode::fitted_blocks(ctx.num_blocks, c.fit_ranks_on_device, ctx.full_first,
                                                  c.sm_share_percent, ctx.start_together);
    }
    return ctx;
}

int64_t row_bytes(const torch::Tensor& t) { return t.dim() < 2 ? 0 : t.size(1) * t.element_size(); }

void intranode_notify(const IntranodeCtx& c, const torch::Tensor& is_token_in_rank,
                      const torch::Tensor& num_tokens_per_rank, const torch::Tensor& num_tokens_per_expert,
                      const torch::Tensor& send_pos, const torch::Tensor& recv_info, int64_t nonce) {
    const c10::cuda::CUDAGuard guard(is_token_in_rank.device());
    for (const auto* t : {&is_token_in_rank, &num_tokens_per_rank, &num_tokens_per_expert, &send_pos, &recv_info})
        TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "intranode_notify: expected contiguous CUDA tensors");
    intranode::notify(make_ctx(c, c.num_ranks), is_token_in_rank.data_ptr<bool>(), static_cast<int>(is_token_in_rank.size(0)),
                      num_tokens_per_rank.data_ptr<int>(), num_tokens_per_expert.data_ptr<int>(),
                      static_cast<int>(num_tokens_per_expert.size(0)), send_pos.data_ptr<int>(), recv_info.data_ptr<int>(),
                      static_cast<int>(nonce));
}

// Where a one-pass kernel records its call's path (PathChoice): one int32 each on the GPU.
intranode::PathChoice path_choice(const torch::Tensor& choice, const torch::Tensor& one_pass_calls, int64_t nonce) {
    for (const auto* t : {&choice, &one_pass_calls})
        TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kInt32 && t->numel() == 1,
                    "choice, one_pass_calls: expected one int32 each on the GPU");
    return {choice.data_ptr<int>(), one_pass_calls.data_ptr<int>(), static_cast<int>(nonce)};
}

// A two-pass kernel queued behind a one-pass kernel runs only where that one chose it (and needs no
// rendezvous: the one-pass kernel met every rank).
template <typename Args>  // intranode::DispatchArgs or CombineArgs
void set_choice(Args& a, const std::optional<torch::Tensor>& choice) {
    a.choice = optional_ptr<const int>(choice);
}

// The arguments both dispatches share; each sets where the rows go.
intranode::DispatchArgs dispatch_args(const torch::Tensor& x, const std::optional<torch::Tensor>& scales,
                                      const std::optional<torch::Tensor>& topk_idx,
                                      const std::optional<torch::Tensor>& topk_weights, int64_t experts_per_rank,
                                      const torch::Tensor& send_pos, const torch::Tensor& recv_info,
                                      const std::optional<torch::Tensor>& recv_topk_idx,
                                      const std::optional<torch::Tensor>& recv_topk_weights,
                                      const torch::Tensor& recv_src_idx) {
    check_rows(x, "x");
    intranode::DispatchArgs a{};
    a.x = x.data_ptr();
    a.x_bytes = row_bytes(x);
    a.scales = scales.has_value() ? scales->data_ptr() : nullptr;
    a.scale_bytes = scales.has_value() ? row_bytes(*scales) : 0;
    a.topk_idx = optional_ptr<const int64_t>(topk_idx);
    a.topk_weights = optional_ptr<const float>(topk_weights);
    a.num_topk = topk_idx.has_value() ? static_cast<int>(topk_idx->size(1)) : 0;
    a.experts_per_rank = static_cast<int>(experts_per_rank);
    a.send_pos = send_pos.data_ptr<int>();
    a.num_tokens = static_cast<int>(x.size(0));
    a.recv_info = recv_info.data_ptr<int>();
    a.recv_topk_idx = optional_ptr<int64_t>(recv_topk_idx);
    a.recv_topk_weights = optional_ptr<float>(recv_topk_weights);
    a.recv_src_idx = recv_src_idx.data_ptr<int>();
    return a;
}

void intranode_dispatch(const IntranodeCtx& c, int64_t num_blocks, const torch::Tensor& x,
                        const std::optional<torch::Tensor>& scales, const std::optional<torch::Tensor>& topk_idx,
                        const std::optional<torch::Tensor>& topk_weights, int64_t experts_per_rank,
                        const torch::Tensor& send_pos, const torch::Tensor& recv_info, const torch::Tensor& recv_x,
                        const std::optional<torch::Tensor>& recv_scales,
                        const std::optional<torch::Tensor>& recv_topk_idx,
                        const std::optional<torch::Tensor>& recv_topk_weights, const torch::Tensor& recv_src_idx,
                        bool cached, const std::optional<torch::Tensor>& choice) {
    const c10::cuda::CUDAGuard guard(x.device());
    check_rows(recv_x, "recv_x");
    intranode::DispatchArgs a = dispatch_args(x, scales, topk_idx, topk_weights, experts_per_rank, send_pos, recv_info,
                                              recv_topk_idx, recv_topk_weights, recv_src_idx);
    a.recv_x = recv_x.data_ptr();
    a.recv_scales = optional_ptr<void>(recv_scales);
    a.num_recv_rows = static_cast<int>(recv_x.size(0));
    set_choice(a, choice);
    const int opens = cached && !choice.has_value() ? intranode::kKernelDispatch : 0;
    intranode::dispatch(data_ctx(c, num_blocks, /*combine=*/false, opens), a);
}

// Zero-copy dispatch: the rows go straight into the receivers' zero-copy areas (areas: device int64
// [R], every rank's area as mapped here), slot at slot_offset laid out by offsets (config.py,
// zero_copy_dispatch_slot); recv_x and recv_scales are this rank's slot, so only their shapes are read.
void intranode_zero_copy_dispatch(const IntranodeCtx& c, int64_t num_blocks, const torch::Tensor& x,
                                  const std::optional<torch::Tensor>& scales,
                                  const std::optional<torch::Tensor>& topk_idx,
                                  const std::optional<torch::Tensor>& topk_weights, int64_t experts_per_rank,
                                  const torch::Tensor& send_pos, const torch::Tensor& recv_info, int64_t num_recv_rows,
                                  const std::optional<torch::Tensor>& recv_topk_idx,
                                  const std::optional<torch::Tensor>& recv_topk_weights,
                                  const torch::Tensor& recv_src_idx, int64_t areas, int64_t slot_offset,
                                  int64_t capacity_rows, const std::vector<int64_t>& offsets, int64_t region_bytes,
                                  bool cached, const torch::Tensor& choice, const torch::Tensor& one_pass_calls,
                                  int64_t nonce) {
    const c10::cuda::CUDAGuard guard(x.device());
    TORCH_CHECK(offsets.size() == 5, "offsets: expected x, scale, idx, weight and src offsets");
    TORCH_CHECK(num_recv_rows <= std::max<int64_t>(capacity_rows, 0), "num_recv_rows: more than the region holds");
    intranode::DispatchArgs a = dispatch_args(x, scales, topk_idx, topk_weights, experts_per_rank, send_pos, recv_info,
                                              recv_topk_idx, recv_topk_weights, recv_src_idx);
    a.num_recv_rows = static_cast<int>(num_recv_rows);
    const intranode::ZeroCopyDispatchArgs z{reinterpret_cast<uint8_t* const*>(areas), slot_offset, capacity_rows,
                                            offsets[0], offsets[1], offsets[2], offsets[3], offsets[4], region_bytes,
                                            path_choice(choice, one_pass_calls, nonce)};
    // A fresh dispatch's count exchange already keeps its kernel from starting before every rank arrived.
    const int opens = cached ? intranode::kKernelZeroCopyDispatch : 0;
    intranode::zero_copy_dispatch(data_ctx(c, num_blocks, /*combine=*/false, opens), a, z);
}

// The communication stream waits for the caller's stream (else the caller made it wait for its
// previous_event).
void order_after(const c10::cuda::CUDAStream& compute, const c10::cuda::CUDAStream& comm, int device) {
    // One event per thread and device, made once: recorded and waited on at once, so reusing it is safe.
    static thread_local std::unordered_map<int, cudaEvent_t> caller_done;
    auto found = caller_done.find(device);
    if (found == caller_done.end()) {
        cudaEvent_t e;
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        found = caller_done.emplace(device, e).first;
    }
    C10_CUDA_CHECK(cudaEventRecord(found->second, compute.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(comm.stream(), found->second, 0));
}

c10::cuda::CUDAStream external_stream(int64_t stream, const torch::Tensor& on) {
    return c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(stream), on.device().index());
}

py::object or_none(const std::optional<torch::Tensor>& t) { return t.has_value() ? py::cast(*t) : py::none(); }

// A fresh dispatch's received top-k ids and weights for `rows` rows (none without top-k), on the
// current stream.
std::pair<std::optional<torch::Tensor>, std::optional<torch::Tensor>> recv_topk_outputs(
    int64_t rows, const std::optional<torch::Tensor>& topk_idx, const torch::Tensor& x) {
    if (!topk_idx.has_value()) return {};
    const int64_t k = topk_idx->size(1);
    return {torch::empty({rows, k}, x.options().dtype(torch::kInt64)),
            torch::empty({rows, k}, x.options().dtype(torch::kFloat32))};
}

// The count exchange of a fresh dispatch on the communication stream (current): (send_pos, recv_info).
std::pair<torch::Tensor, torch::Tensor> launch_notify(const IntranodeCtx& c, const torch::Tensor& x,
                                                      const torch::Tensor& is_token_in_rank,
                                                      const torch::Tensor& num_tokens_per_rank,
                                                      const torch::Tensor& num_tokens_per_expert, int64_t nonce,
                                                      int64_t recv_info_ints) {
    const auto ints = x.options().dtype(torch::kInt32);
    torch::Tensor send_pos = torch::empty({x.size(0), c.num_ranks}, ints);
    torch::Tensor recv_info = torch::empty({recv_info_ints}, ints);
    intranode_notify(c, is_token_in_rank.contiguous(), num_tokens_per_rank.contiguous(),
                     num_tokens_per_expert.contiguous(), send_pos, recv_info, nonce);
    return {send_pos, recv_info};
}

// A fresh zero-copy dispatch whose row count the host does not know yet, from one Python call: its
// host time is on the critical path at 2 ranks, and each torch call from Python (stream switches,
// allocations, the stream ordering's event) costs microseconds more than here. Orders the
// communication stream after the caller's (order_after_caller; else the caller made it wait for its
// previous_event), allocates the handle's state on the communication stream and the side outputs for
// a full slot on the allocation stream, and launches the count exchange and the dispatch behind it.
// region_bytes >= 0: into a dispatch arena's region of that size at slot_offset, which the kernel lays
// out (capacity_rows: the most rows that could fit, which sizes the side outputs).
// -> (send_pos [N, R], recv_info, recv_src_idx [capacity], recv_topk_idx or None, recv_topk_weights or None)
py::tuple intranode_zero_copy_dispatch_early(
    const IntranodeCtx& c, int64_t num_blocks, const torch::Tensor& x, const std::optional<torch::Tensor>& scales,
    const std::optional<torch::Tensor>& topk_idx, const std::optional<torch::Tensor>& topk_weights,
    const torch::Tensor& is_token_in_rank, const torch::Tensor& num_tokens_per_rank,
    const torch::Tensor& num_tokens_per_expert, int64_t experts_per_rank,
    int64_t nonce, int64_t recv_info_ints, int64_t comm_stream, bool order_after_caller, bool allocate_on_comm_stream,
    int64_t areas, int64_t slot_offset, int64_t capacity_rows, const std::vector<int64_t>& offsets,
    int64_t region_bytes, const torch::Tensor& choice, const torch::Tensor& one_pass_calls) {
    const c10::cuda::CUDAGuard guard(x.device());
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
    const c10::cuda::CUDAStream comm = external_stream(comm_stream, x);
    if (order_after_caller) order_after(compute, comm, x.device().index());
    torch::Tensor send_pos, recv_info, recv_src_idx;
    {
        const c10::cuda::CUDAStreamGuard on_comm(comm);
        std::tie(send_pos, recv_info) = launch_notify(c, x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, nonce,
                                                    recv_info_ints);
        recv_src_idx = torch::empty({capacity_rows}, x.options().dtype(torch::kInt32));
    }
    std::optional<torch::Tensor> recv_topk_idx, recv_topk_weights;
    {
        const c10::cuda::CUDAStreamGuard on_alloc(allocate_on_comm_stream ? comm : compute);
        std::tie(recv_topk_idx, recv_topk_weights) = recv_topk_outputs(capacity_rows, topk_idx, x);
    }
    {
        const c10::cuda::CUDAStreamGuard on_comm(comm);
        // The kernel lays out its region for the rows its count exchange brings and, with every rank's
        // room, chooses the path; the host reads the choice with the counts.
        intranode_zero_copy_dispatch(c, num_blocks, x, scales, topk_idx, topk_weights, experts_per_rank, send_pos,
                                     recv_info, -1, recv_topk_idx, recv_topk_weights, recv_src_idx, areas, slot_offset,
                                     capacity_rows, offsets, region_bytes, /*cached=*/false, choice, one_pass_calls,
                                     nonce);
    }
    return py::make_tuple(send_pos, recv_info, recv_src_idx, or_none(recv_topk_idx), or_none(recv_topk_weights));
}

// A fresh ordinary dispatch without num_worst_tokens, from one Python call: the count exchange, the
// host's wait for the counts (without the GIL), the outputs sized by them and the dispatch. What runs
// between the counts' arrival and the dispatch's launch is on the 2-rank call's critical path, and
// from Python each stream switch and allocation there costs microseconds more. Stream order and
// allocation streams as intranode_zero_copy_dispatch_early; counts at host_info[host_counts]: R
// received, R sent, then experts_per_rank per local expert.
// -> None when the counts did not arrive within wait_s (the caller reports why), else (send_pos,
//    recv_info, recv_src_idx, recv_x, recv_scales or None, recv_topk_idx or None, recv_topk_weights or
//    None, recv_counts, send_counts, per_expert_counts)
py::object intranode_dispatch_fresh(
    const IntranodeCtx& c, int64_t num_blocks, const torch::Tensor& x, const std::optional<torch::Tensor>& scales,
    const std::optional<torch::Tensor>& topk_idx, const std::optional<torch::Tensor>& topk_weights,
    const torch::Tensor& is_token_in_rank, const torch::Tensor& num_tokens_per_rank,
    const torch::Tensor& num_tokens_per_expert, int64_t experts_per_rank,
    int64_t nonce, int64_t recv_info_ints, int64_t comm_stream, bool order_after_caller, bool allocate_on_comm_stream,
    int64_t host_done, int64_t host_counts, double wait_s) {
    const c10::cuda::CUDAGuard guard(x.device());
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream();
    const c10::cuda::CUDAStream comm = external_stream(comm_stream, x);
    if (order_after_caller) order_after(compute, comm, x.device().index());
    torch::Tensor send_pos, recv_info;
    {
        const c10::cuda::CUDAStreamGuard on_comm(comm);
        std::tie(send_pos, recv_info) = launch_notify(c, x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, nonce,
                                                    recv_info_ints);
    }
    if (!wait_host_value(c.host_info, host_done, nonce, wait_s)) return py::none();
    const int* h = c.host_info.data_ptr<int>() + host_counts;
    const int R = c.num_ranks;
    const std::vector<int> recv_counts(h, h + R), send_counts(h + R, h + 2 * R),
        per_expert(h + 2 * R, h + 2 * R + experts_per_rank);
    int64_t rows = 0;
    for (const int n : recv_counts) rows += n;
    torch::Tensor recv_src_idx;
    {
        const c10::cuda::CUDAStreamGuard on_comm(comm);
        recv_src_idx = torch::empty({rows}, x.options().dtype(torch::kInt32));
    }
    torch::Tensor recv_x;
    std::optional<torch::Tensor> recv_scales, recv_topk_idx, recv_topk_weights;
    {
        const c10::cuda::CUDAStreamGuard on_alloc(allocate_on_comm_stream ? comm : compute);
        recv_x = torch::empty({rows, x.size(1)}, x.options());
        if (scales.has_value()) recv_scales = torch::empty({rows, scales->size(1)}, scales->options());
        std::tie(recv_topk_idx, recv_topk_weights) = recv_topk_outputs(rows, topk_idx, x);
    }
    {
        const c10::cuda::CUDAStreamGuard on_comm(comm);
        intranode_dispatch(c, num_blocks, x, scales, topk_idx, topk_weights, experts_per_rank, send_pos, recv_info,
                           recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, /*cached=*/false,
                           std::nullopt);
    }
    return py::make_tuple(send_pos, recv_info, recv_src_idx, recv_x, or_none(recv_scales), or_none(recv_topk_idx),
                          or_none(recv_topk_weights), recv_counts, send_counts, per_expert);
}

// The arguments both combines share; x's rows are checked by the caller (the zero-copy view is strided).
intranode::CombineArgs combine_args(const torch::Tensor& x, const std::optional<torch::Tensor>& topk_weights,
                                    const torch::Tensor& recv_src_idx, const torch::Tensor& recv_info,
                                    const torch::Tensor& send_pos, const std::optional<torch::Tensor>& bias0,
                                    const std::optional<torch::Tensor>& bias1, const torch::Tensor& out,
                                    const std::optional<torch::Tensor>& out_weights) {
    check_rows(out, "out");
    for (const auto* b : {&bias0, &bias1})
        if (b->has_value()) check_rows(**b, "bias");
    intranode::CombineArgs a{};
    a.x = x.data_ptr();
    a.dtype = dtype_of(x, "x");
    a.hidden = static_cast<int>(x.size(1));
    a.topk_weights = optional_ptr<const float>(topk_weights);
    a.num_topk = topk_weights.has_value() ? static_cast<int>(topk_weights->size(1)) : 0;
    a.recv_src_idx = recv_src_idx.data_ptr<int>();
    a.recv_info = recv_info.data_ptr<int>();
    a.send_pos = send_pos.data_ptr<int>();
    a.num_tokens = static_cast<int>(out.size(0));
    a.bias0 = optional_ptr<const void>(bias0);
    a.bias1 = optional_ptr<const void>(bias1);
    a.out = out.data_ptr();
    a.out_weights = optional_ptr<float>(out_weights);
    return a;
}

void intranode_combine(const IntranodeCtx& c, int64_t num_blocks, const torch::Tensor& x,
                       const std::optional<torch::Tensor>& topk_weights, const torch::Tensor& recv_src_idx,
                       const torch::Tensor& recv_info, const torch::Tensor& send_pos,
                       const std::optional<torch::Tensor>& bias0, const std::optional<torch::Tensor>& bias1,
                       const torch::Tensor& out, const std::optional<torch::Tensor>& out_weights, int64_t send_chunk,
                       const std::optional<torch::Tensor>& choice) {
    const c10::cuda::CUDAGuard guard(x.device());
    check_rows(x, "x");
    intranode::CombineArgs a = combine_args(x, topk_weights, recv_src_idx, recv_info, send_pos, bias0, bias1, out, out_weights);
    a.send_chunk = static_cast<int>(std::min<int64_t>(std::max<int64_t>(send_chunk, 0), 1 << 24));
    set_choice(a, choice);
    intranode::combine(data_ctx(c, num_blocks, /*combine=*/true, choice.has_value() ? 0 : intranode::kKernelCombine), a);
}

// x: rows in this rank's arena (areas: device int64 [R], every rank's arena as mapped here), row 0 at
// slot_offset, pitch bytes apart, their weights at weights_offset; capacity_rows < 0: no room was found
// (the two-pass combine queued behind then runs on every rank).
void intranode_zero_copy_combine(const IntranodeCtx& c, int64_t num_blocks, const torch::Tensor& x,
                                 const std::optional<torch::Tensor>& topk_weights, const torch::Tensor& recv_src_idx,
                                 const torch::Tensor& recv_info, const torch::Tensor& send_pos,
                                 const std::optional<torch::Tensor>& bias0, const std::optional<torch::Tensor>& bias1,
                                 const torch::Tensor& out, const std::optional<torch::Tensor>& out_weights,
                                 int64_t areas, int64_t slot_offset, int64_t pitch, int64_t capacity_rows,
                                 int64_t weights_offset, const torch::Tensor& choice, const torch::Tensor& one_pass_calls) {
    const c10::cuda::CUDAGuard guard(x.device());
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) * x.element_size() == pitch,
                "x: expected rows ", pitch, " bytes apart in mapped memory");
    TORCH_CHECK(slot_offset % 16 == 0 && pitch % 16 == 0 && weights_offset % 16 == 0,
                "x: rows in mapped memory must start 16-byte aligned");
    const intranode::ZeroCopyArgs z{reinterpret_cast<uint8_t* const*>(areas), slot_offset, pitch, capacity_rows,
                                    weights_offset, path_choice(choice, one_pass_calls, 0)};
    intranode::CombineArgs a = combine_args(x, topk_weights, recv_src_idx, recv_info, send_pos, bias0, bias1, out,
                                            out_weights);
    intranode::zero_copy_combine(data_ctx(c, num_blocks, /*combine=*/true, intranode::kKernelZeroCopyCombine), a, z);
}

void intranode_check_blocks(const IntranodeCtx& c, int64_t num_blocks) { intranode::check_blocks_fit(make_ctx(c, num_blocks)); }
int64_t intranode_launch_blocks(const IntranodeCtx& c, int64_t num_blocks, bool combine) {
    return data_ctx(c, num_blocks, combine).num_blocks;
}

int64_t intranode_stream_ring_rows(const IntranodeCtx& c, int64_t num_blocks, int64_t x_bytes, int64_t num_topk) {
    return intranode::stream_ring_rows(data_ctx(c, num_blocks, /*combine=*/true), x_bytes, static_cast<int>(num_topk));
}


// The layout numbers the kernels use, for the test that moe_ep/config.py computes the same.
py::dict intranode_layout(int64_t num_ranks, int64_t num_nvl_bytes, int64_t x_bytes, int64_t scale_bytes, int64_t num_topk) {
    const int r = static_cast<int>(num_ranks), k = static_cast<int>(num_topk);
    py::dict d;
    d["header_bytes"] = intranode::header_bytes(r);
    d["half_bytes"] = intranode::half_bytes(num_nvl_bytes, r);
    d["dispatch_slot_bytes"] = intranode::dispatch_slot(r, x_bytes, scale_bytes, k).bytes;
    d["combine_slot_bytes"] = intranode::combine_slot_bytes(x_bytes, k);
    d["dispatch_window_tokens"] = intranode::dispatch_window_tokens(r, num_nvl_bytes, x_bytes, scale_bytes, k);
    d["combine_window_tokens"] = intranode::combine_window_tokens(r, num_nvl_bytes, x_bytes, k);
    d["host_info_ints"] = intranode::host_info_ints(r);
    d["wait_slots"] = intranode::kWaitSlots;
    d["kernel_log_ints"] = intranode::kernel_log_ints();
    d["recv_info_ints"] = intranode::recv_info_ints(r);
    d["recv_info_prefix_matrix"] = intranode::recv_info_prefix_matrix(r);
    return d;
}

// {name: value} of one of kernels/reports.cuh's tables (Python: moe_ep.backends.peers.Enumerators).
py::dict named_values(const NamedTable& table) {
    py::dict d;
    for (int i = 0; i < table.size; ++i) d[table.values[i].name] = table.values[i].value;
    return d;
}

}  // namespace

}  // namespace moe_ep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "moe_ep CUDA kernels";
    m.def("get_dispatch_layout", &moe_ep::get_dispatch_layout, "dispatch layout from topk_idx");
    m.def("fp8_cast", &moe_ep::fp8_cast, "1x128 per-token e4m3 cast");
    m.def("fp8_blockwise_cast", &moe_ep::fp8_blockwise_cast, "1x128 e4m3 cast under transformer-engine's rule");
    m.def("fp8_cast_back", &moe_ep::fp8_cast_back, "1x128 per-token e4m3 cast back");
    m.def("count_low_latency_rows", &moe_ep::count_low_latency_rows,
          "adds a low-latency call's bytes per rank and tokens per local expert to Buffer.stats()'s counters");
    m.def("ipc_alloc", &moe_ep::ipc_alloc, "zeroed device buffer and its CUDA IPC handle");
    m.def("ipc_open", &moe_ep::ipc_open, "map a peer's buffer");
    m.def("ipc_close", &moe_ep::ipc_close, "unmap a peer's buffer");
    m.def("device_free", &moe_ep::device_free, "free a buffer from ipc_alloc");
    m.def("device_zero", &moe_ep::device_zero, "zero device memory and wait");
    m.def("vmm_supported", [] { return moe_ep::peer_memory::supported(c10::cuda::current_device()); },
          "whether this GPU can export memory as file descriptors (the virtual-memory API)");
    m.def("vmm_alloc", &moe_ep::vmm_alloc, "zeroed device buffer, its size, handle and an exported file descriptor");
    m.def("vmm_import", &moe_ep::vmm_import, "map a peer's buffer from its file descriptor");
    m.def("vmm_release", &moe_ep::vmm_release, "unmap a buffer from vmm_alloc or vmm_import");
    m.def("wait_host_value", &moe_ep::wait_host_value, "spin on a host-mapped counter");
    py::class_<moe_ep::IntranodeCtx>(m, "IntranodeCtx")
        .def(py::init<int64_t, int, int, int64_t, torch::Tensor, double, int>())
        .def_readwrite("timeout_s", &moe_ep::IntranodeCtx::timeout_s)
        .def_readwrite("wait_ns", &moe_ep::IntranodeCtx::wait_ns)
        .def_readwrite("kernel_log", &moe_ep::IntranodeCtx::kernel_log)
        .def_readwrite("stream_combine", &moe_ep::IntranodeCtx::stream_combine)
        .def_readwrite("rendezvous", &moe_ep::IntranodeCtx::rendezvous)
        .def_readwrite("fit_ranks_on_device", &moe_ep::IntranodeCtx::fit_ranks_on_device)
        .def_readwrite("sm_share_percent", &moe_ep::IntranodeCtx::sm_share_percent);
    m.def("intranode_launch_blocks", &moe_ep::intranode_launch_blocks,
          "blocks of a dispatch (or with combine, a combine) kernel for an SM budget (fitted to the ranks sharing a GPU)",
          py::arg("ctx"), py::arg("num_blocks"), py::arg("combine") = false);
    m.def("intranode_stream_ring_rows", &moe_ep::intranode_stream_ring_rows,
          "rows per ring of the streaming combine (0: the combine uses windows)");
    m.def("intranode_notify", &moe_ep::intranode_notify, "count exchange of an intranode dispatch");
    m.def("intranode_dispatch", &moe_ep::intranode_dispatch, "intranode dispatch data movement");
    m.def("intranode_zero_copy_dispatch", &moe_ep::intranode_zero_copy_dispatch,
          "intranode dispatch straight into every rank's zero-copy area");
    m.def("intranode_combine", &moe_ep::intranode_combine, "intranode combine");
    m.def("intranode_zero_copy_combine", &moe_ep::intranode_zero_copy_combine,
          "intranode combine of rows that lie in every rank's zero-copy area");
    m.def("intranode_check_blocks", &moe_ep::intranode_check_blocks, "ValueError unless the blocks fit the GPU");
    m.def("intranode_dispatch_fresh", &moe_ep::intranode_dispatch_fresh,
          "a fresh ordinary dispatch in one call: count exchange, the wait for the counts, outputs, dispatch");
    m.def("intranode_zero_copy_dispatch_early", &moe_ep::intranode_zero_copy_dispatch_early,
          "a fresh zero-copy dispatch in one call: stream order, allocations, count exchange and dispatch launched");
    moe_ep::bind_low_latency(m);
    m.def("intranode_layout", &moe_ep::intranode_layout, "buffer layout numbers of the intranode kernels");
    // The numbers the kernels report by, as kernels/reports.cuh defines them (moe_ep.backends.peers.KernelEnums):
    // HOST_INFO, KERNEL_IDS, ..., each a {name: value} dict.
    for (const moe_ep::NamedTable& table : moe_ep::kReportTables) m.attr(table.name) = moe_ep::named_values(table);
    m.attr("INTRANODE_MAX_RANKS") = moe_ep::intranode::kMaxRanks;
#ifdef MOE_EP_WITH_NVSHMEM
    m.attr("WITH_NVSHMEM") = true;
    m.attr("NVSHMEM_REASON") = "";
    m.def("nvshmem_version", &moe_ep::nvshmem_version, "version of the linked NVSHMEM host library");
    m.def("nvshmem_unique_id", [](){ return py::bytes(moe_ep::nvshmem_unique_id()); }, "a fresh NVSHMEM unique id");
    m.def("nvshmem_initialized", &moe_ep::nvshmem_initialized, "NVSHMEM is initialised in this process");
    m.def("nvshmem_init_with_unique_id", &moe_ep::nvshmem_init_with_unique_id, "initialise NVSHMEM as PE `rank`");
    m.def("nvshmem_pe", &moe_ep::nvshmem_pe, "this process's PE");
    m.def("nvshmem_num_pes", &moe_ep::nvshmem_num_pes, "number of PEs");
    m.def("nvshmem_alloc", &moe_ep::nvshmem_alloc, "collective symmetric allocation");
    m.def("nvshmem_release", &moe_ep::nvshmem_release, "collective free of a symmetric allocation");
    m.def("nvshmem_peer_pointer", &moe_ep::nvshmem_peer_pointer, "a PE's copy of a symmetric address, or 0");
#else
    m.attr("WITH_NVSHMEM") = false;
    m.attr("NVSHMEM_REASON") = MOE_EP_NVSHMEM_REASON;
#endif
#ifdef MOE_EP_SM90_COMPILED
    m.attr("SM90_COMPILED") = true;
#else
    m.attr("SM90_COMPILED") = false;
#endif
}
