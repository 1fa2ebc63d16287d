// Bindings of the low-latency kernels (kernels/low_latency.cu), shared by the two modules that build
// them: moe_ep._C (for groups whose peers are all mapped) and moe_ep._internode (the same kernels with
// NVSHMEM's device library, for groups where some peer only puts reach). Internal linkage: each module
// its own copy.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <optional>

#include "kernels/api.cuh"
#include "kernels/buffer_layout.cuh"
#include "torch_args.h"

namespace moe_ep {
namespace {

struct LowLatencyCtx {
    int64_t buffers;
    int rank, num_ranks, ranks_on_device;
    torch::Tensor host_info;
    double timeout_s;
    int num_max_tokens, hidden, num_experts;
};

low_latency::Ctx make_ctx(const LowLatencyCtx& c) {
    low_latency::Ctx ctx;
    ctx.buffers = reinterpret_cast<uint8_t* const*>(c.buffers);
    ctx.rank = c.rank;
    ctx.num_ranks = c.num_ranks;
    ctx.ranks_on_device = c.ranks_on_device;
    ctx.num_max_tokens = c.num_max_tokens;
    ctx.hidden = c.hidden;
    ctx.num_experts = c.num_experts;
    ctx.host_info = c.host_info.data_ptr<int>();
    ctx.timeout_ns = static_cast<uint64_t>(c.timeout_s * 1e9);
    ctx.stream = current_stream();
    return ctx;
}

// Allocates the receive tensors here (a decode step's host time counts, and each allocation from
// Python costs microseconds more than from C++) and launches the send kernel.
// -> (recv_x [L, R * max, H], recv_scales or None, recv_count [L], recv_src_info [L, R * max]); the
// send kernel zeroes the counts (no fill kernel per call) and the receive kernel writes them.
py::tuple ll_dispatch_send(const LowLatencyCtx& c, const torch::Tensor& x, const torch::Tensor& topk_idx, bool use_fp8,
                           bool round_scale, bool use_ue8m0) {
    const c10::cuda::CUDAGuard guard(x.device());
    check_rows(x, "x");
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && topk_idx.is_contiguous(), "x: bf16; topk_idx: contiguous");
    const int64_t local = c.num_experts / c.num_ranks, rows = static_cast<int64_t>(c.num_ranks) * c.num_max_tokens;
    const auto on_device = torch::TensorOptions().device(x.device());
    auto recv_x = torch::empty({local, rows, c.hidden}, on_device.dtype(use_fp8 ? torch::kFloat8_e4m3fn : torch::kBFloat16));
    py::object recv_scales = py::none();
    if (use_fp8) {
        const int64_t blocks = c.hidden / fp8::kBlock;
        recv_scales = py::cast(use_ue8m0 ? torch::empty({local, rows, (blocks + 3) / 4}, on_device.dtype(torch::kInt32))
                                         : torch::empty({local, rows, blocks}, on_device.dtype(torch::kFloat32)));
    }
    auto recv_count = torch::empty({local}, on_device.dtype(torch::kInt32));
    auto recv_src_info = torch::empty({local, rows}, on_device.dtype(torch::kInt32));
    low_latency::dispatch_send(make_ctx(c), x.data_ptr(), static_cast<int>(x.size(0)), topk_idx.data_ptr<int64_t>(),
                               static_cast<int>(topk_idx.size(1)), use_fp8, round_scale, use_ue8m0,
                               recv_count.data_ptr<int>());
    return py::make_tuple(recv_x, recv_scales, recv_count, recv_src_info);
}

void ll_dispatch_recv(const LowLatencyCtx& c, int64_t num_topk, bool use_fp8, bool use_ue8m0, const torch::Tensor& recv_x,
                      const std::optional<torch::Tensor>& recv_scales, const torch::Tensor& recv_count,
                      const std::optional<torch::Tensor>& stats, const torch::Tensor& recv_src_info) {
    const c10::cuda::CUDAGuard guard(recv_x.device());
    check_rows(recv_x, "recv_x");
    low_latency::dispatch_recv(make_ctx(c), static_cast<int>(num_topk), use_fp8, use_ue8m0, recv_x.data_ptr(),
                               optional_ptr<void>(recv_scales), recv_count.data_ptr<int>(), optional_ptr<int>(stats),
                               recv_src_info.data_ptr<int>(), num_sms_of_current_device());
}

// Launches the send kernel; returns `out`, or where none is given a new [num_tokens, hidden] bf16
// tensor for the receive (allocated here for the same reason as ll_dispatch_send's outputs).
// slot: the zero-copy rows (0 or 1) the combine owns; how: a low_latency::CombineSend (the module's
// COMBINE_IN_SLOT, COMBINE_STAGE, COMBINE_PUSH).
torch::Tensor ll_combine_send(const LowLatencyCtx& c, const torch::Tensor& x, const torch::Tensor& recv_count,
                              const torch::Tensor& recv_src_info, int64_t num_topk, int64_t num_tokens,
                              const std::optional<torch::Tensor>& out, int64_t slot, int64_t how) {
    const c10::cuda::CUDAGuard guard(x.device());
    check_rows(x, "x");
    TORCH_CHECK(slot == 0 || slot == 1, "slot: 0 or 1, got ", slot);
    TORCH_CHECK(how >= 0 && how <= static_cast<int>(low_latency::CombineSend::kPush), "how: a CombineSend, got ", how);
    auto target = out.has_value() ? *out : torch::empty({num_tokens, c.hidden}, x.options().dtype(torch::kBFloat16));
    low_latency::combine_send(make_ctx(c), x.data_ptr(), recv_count.data_ptr<int>(), recv_src_info.data_ptr<int>(),
                              static_cast<int>(num_topk), num_sms_of_current_device(), static_cast<int>(slot),
                              static_cast<low_latency::CombineSend>(how));
    return target;
}

// The low-latency kernels' timeline (api.cuh; a build with MOE_EP_TIMELINE=1): int64 [calls, columns]
// on the host, columns in TimelineColumn's order.
torch::Tensor ll_timeline() {
    auto out = torch::empty({low_latency::kTimelineCalls, low_latency::kTimelineColumns}, torch::kInt64);
    low_latency::timeline_read(out.data_ptr<int64_t>());
    return out;
}

void ll_combine_recv(const LowLatencyCtx& c, const torch::Tensor& topk_idx, const torch::Tensor& topk_weights,
                     const torch::Tensor& out, int64_t zero_copy_slot) {
    const c10::cuda::CUDAGuard guard(out.device());
    check_rows(out, "out");
    TORCH_CHECK(topk_idx.is_contiguous() && topk_weights.is_contiguous(), "topk_idx, topk_weights: contiguous");
    low_latency::combine_recv(make_ctx(c), topk_idx.data_ptr<int64_t>(), topk_weights.data_ptr<float>(),
                              static_cast<int>(topk_idx.size(0)), static_cast<int>(topk_idx.size(1)), out.data_ptr(),
                              num_sms_of_current_device(), static_cast<int>(zero_copy_slot));
}

py::dict low_latency_layout(int64_t num_max_tokens, int64_t hidden, int64_t num_ranks, int64_t num_experts) {
    const auto r = low_latency::regions(num_max_tokens, hidden, num_ranks, num_experts);
    py::dict d;
    d["dispatch_message_bytes"] = r.dispatch_message;
    d["dispatch_messages_offset"] = low_latency::dispatch_messages_offset(num_experts, num_max_tokens);
    d["combine_message_bytes"] = r.combine_message;
    d["zero_copy_offset"] = r.zero_copy_offset;
    d["outbox_offset"] = r.outbox_offset;
    d["send_bytes"] = r.send;
    d["recv_bytes"] = r.recv;
    d["signal_bytes"] = r.signal;
    d["half_bytes"] = r.half;
    d["total_bytes"] = r.total;
    return d;
}

void bind_low_latency(py::module_& m) {
    // module_local: both extension modules bind the type, and pybind11 would otherwise refuse the second.
    py::class_<LowLatencyCtx>(m, "LowLatencyCtx", py::module_local())
        .def(py::init<int64_t, int, int, int, torch::Tensor, double, int, int, int>());
    m.def("ll_dispatch_send", &ll_dispatch_send, "low-latency dispatch: send");
    m.def("ll_dispatch_recv", &ll_dispatch_recv, "low-latency dispatch: receive (the hook)");
    m.def("ll_combine_send", &ll_combine_send, "low-latency combine: send");
    m.attr("COMBINE_IN_SLOT") = static_cast<int>(low_latency::CombineSend::kInSlot);
    m.attr("COMBINE_STAGE") = static_cast<int>(low_latency::CombineSend::kStage);
    m.attr("COMBINE_PUSH") = static_cast<int>(low_latency::CombineSend::kPush);
    m.def("ll_combine_recv", &ll_combine_recv, "low-latency combine: receive (the hook)");
    m.def("ll_timeline_built", &low_latency::timeline_built, "whether the kernels stamp a timeline");
    m.def("ll_timeline_reset", &low_latency::timeline_reset, "clears the low-latency kernels' timeline");
    m.def("ll_timeline", &ll_timeline, "the low-latency kernels' timeline, [calls, columns] int64");
    m.def("low_latency_layout", &low_latency_layout, "buffer layout numbers of the low-latency kernels");
}

}  // namespace
}  // namespace moe_ep
