// The internode module (moe_ep._internode): the NVSHMEM runtime with its device library, and launches
// of the internode kernels. Built apart from moe_ep._C because NVSHMEM's device calls need relocatable
// device code, which the intranode kernels are built without. Arrays come as device addresses of
// tensors that moe_ep/backends/internode.py keeps alive and contiguous for the call.
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <string>

#include "kernels/api.cuh"
#include "kernels/internode/api.cuh"
#include "low_latency_bindings.h"  // kernels/internode/low_latency_puts.cu: the low-latency kernels that put
#include "runtime_nvshmem.h"       // internode_runtime.cpp: the runtime with the device library's initialisation
#include "torch_args.h"

namespace moe_ep {
namespace {

namespace in = internode;

template <typename T>
T* at(int64_t address) { return reinterpret_cast<T*>(address); }

// A Buffer's fixed part of every call's context.
struct Group {
    int64_t base, node_peers, host_info;
    int rank, num_ranks, ranks_per_node;
    double timeout_s;

    in::Ctx ctx(int64_t nonce, int num_sms) const {
        return {at<uint8_t>(base), at<const int64_t>(node_peers), rank, num_ranks, ranks_per_node,
                static_cast<uint64_t>(nonce), at<int>(host_info), timeout_s, num_sms};
    }
};

py::dict limits() {
    py::dict d;
    d["control_bytes"] = in::Control::kBytes;
    d["max_ranks"] = in::kMaxRanks;
    d["max_ranks_per_node"] = in::kMaxRanksPerNode;
    d["max_nodes"] = in::kMaxNodes;
    d["max_chunks"] = in::kMaxChunks;
    d["max_experts"] = in::kMaxExperts;
    d["form_ints"] = static_cast<int>(in::kFormInts);
    return d;
}

py::dict message(int64_t row_bytes, int64_t scale_bytes, int num_topk, int ranks_per_node) {
    const in::Message m{row_bytes, scale_bytes, num_topk, ranks_per_node};
    py::dict d;
    d["scales"] = m.scales();
    d["topk_idx"] = m.topk_idx();
    d["topk_weights"] = m.topk_weights();
    d["source"] = m.source();
    d["rows"] = m.rows();
    d["bytes"] = m.bytes();
    return d;
}

void arrive(const Group& g, int64_t nonce, int64_t row, int row_ints, int64_t expert_counts, int local_experts,
            int64_t matrix) {
    in::arrive(g.ctx(nonce, 1), at<const int>(row), row_ints, at<const int>(expert_counts), local_experts,
               at<int>(matrix), current_stream());
}

in::DispatchArgs dispatch_args(const py::dict& a) {
    in::DispatchArgs d{};
    d.msg = {a["row_bytes"].cast<int64_t>(), a["scale_bytes"].cast<int64_t>(), a["num_topk"].cast<int>(),
             a["ranks_per_node"].cast<int>()};
    d.x = at<const uint8_t>(a["x"].cast<int64_t>());
    d.scales = at<const uint8_t>(a["scales"].cast<int64_t>());
    d.topk_idx = at<const int64_t>(a["topk_idx"].cast<int64_t>());
    d.topk_weights = at<const float>(a["topk_weights"].cast<int64_t>());
    d.send_pos = at<const int>(a["send_pos"].cast<int64_t>());
    d.row_base = at<const int>(a["row_base"].cast<int64_t>());
    d.node_token = at<const int>(a["node_token"].cast<int64_t>());
    d.send_offset = at<const int>(a["send_offset"].cast<int64_t>());
    d.send_count = at<const int>(a["send_count"].cast<int64_t>());
    d.remote_offset = at<const int>(a["remote_offset"].cast<int64_t>());
    d.forward_offset = at<const int>(a["forward_offset"].cast<int64_t>());
    d.forward_count = at<const int>(a["forward_count"].cast<int64_t>());
    d.send_region = a["send_region"].cast<int64_t>();
    d.recv_region = a["recv_region"].cast<int64_t>();
    d.stage_x = a["stage_x"].cast<int64_t>();
    d.stage_scales = a["stage_scales"].cast<int64_t>();
    d.stage_idx = a["stage_idx"].cast<int64_t>();
    d.stage_weights = a["stage_weights"].cast<int64_t>();
    d.stage_source = a["stage_source"].cast<int64_t>();
    d.stage_forward = a["stage_forward"].cast<int64_t>();
    d.num_chunks = a["num_chunks"].cast<int>();
    d.experts_per_rank = a["experts_per_rank"].cast<int>();
    d.forward_mask = at<int>(a["forward_mask"].cast<int64_t>());
    return d;
}

in::CombineArgs combine_args(const py::dict& a) {
    in::CombineArgs c{};
    c.type = static_cast<in::RowType>(a["row_type"].cast<int>());
    c.row_bytes = a["row_bytes"].cast<int64_t>();
    c.num_weights = a["num_weights"].cast<int>();
    c.x = at<const uint8_t>(a["x"].cast<int64_t>());
    c.topk_weights = at<const float>(a["topk_weights"].cast<int64_t>());
    c.num_rows = a["num_rows"].cast<int>();
    c.forward = at<const int2>(a["forward"].cast<int64_t>());
    c.forward_mask = at<const int>(a["forward_mask"].cast<int64_t>());
    c.forward_offset = at<const int>(a["forward_offset"].cast<int64_t>());
    c.forward_count = at<const int>(a["forward_count"].cast<int64_t>());
    c.return_offset = at<const int>(a["return_offset"].cast<int64_t>());
    c.node_pos = at<const int>(a["node_pos"].cast<int64_t>());
    c.send_offset = at<const int>(a["send_offset"].cast<int64_t>());
    c.bias0 = at<const uint8_t>(a["bias0"].cast<int64_t>());
    c.bias1 = at<const uint8_t>(a["bias1"].cast<int64_t>());
    c.num_tokens = a["num_tokens"].cast<int>();
    c.area_region = a["area_region"].cast<int64_t>();
    c.sum_region = a["sum_region"].cast<int64_t>();
    c.return_region = a["return_region"].cast<int64_t>();
    c.forwarded = a["forwarded"].cast<int>();
    c.num_chunks = a["num_chunks"].cast<int>();
    c.out = at<uint8_t>(a["out"].cast<int64_t>());
    c.out_weights = at<float>(a["out_weights"].cast<int64_t>());
    return c;
}

void dispatch(const Group& g, int64_t nonce, int num_sms, const py::dict& a) {
    const in::DispatchArgs args = dispatch_args(a);
    const in::Ctx ctx = g.ctx(nonce, num_sms);
    in::dispatch_send(ctx, args, current_stream());
    in::dispatch_forward(ctx, args, current_stream());
}

void combine(const Group& g, int64_t nonce, int num_sms, const py::dict& a) {
    const in::CombineArgs args = combine_args(a);
    const in::Ctx ctx = g.ctx(nonce, num_sms);
    in::combine_push(ctx, args, current_stream());
    in::combine_forward(ctx, args, current_stream());
    in::combine_reduce(ctx, args, current_stream());
}

// A put of `num_bytes` from `src` to the symmetric `dst` at PE `pe`, then `signal` there set to `value`,
// on the current stream (nvshmem_puts.cu).
void put_with_signal(int64_t dst, int64_t src, int64_t num_bytes, int64_t pe, int64_t signal, int64_t value) {
    nvshmem_puts::put_with_signal(at<void>(dst), at<const void>(src), static_cast<size_t>(num_bytes),
                                  static_cast<int>(pe), at<uint64_t>(signal), static_cast<uint64_t>(value),
                                  current_stream());
}

}  // namespace
}  // namespace moe_ep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "moe_ep internode kernels (NVSHMEM)";
    py::class_<moe_ep::Group>(m, "Group")
        .def(py::init([](int64_t base, int64_t node_peers, int64_t host_info, int rank, int num_ranks,
                         int ranks_per_node, double timeout_s) {
            return moe_ep::Group{base, node_peers, host_info, rank, num_ranks, ranks_per_node, timeout_s};
        }));
    m.def("layout", &moe_ep::limits, "the control area's size and the kernels' limits");
    m.def("message", &moe_ep::message, "byte offsets of a dispatch message's fields");
    m.def("arrive", &moe_ep::arrive, "every rank's arrival at a call, with its counts where given");
    m.def("dispatch", &moe_ep::dispatch, "send and forward of a dispatch");
    m.def("combine", &moe_ep::combine, "push, forward sums and reduce of a combine");
    m.def("nvshmem_version", &moe_ep::nvshmem_version, "version of the linked NVSHMEM host library");
    m.def("nvshmem_unique_id", [](){ return py::bytes(moe_ep::nvshmem_unique_id()); }, "a fresh NVSHMEM unique id");
    m.def("nvshmem_initialized", &moe_ep::nvshmem_initialized, "NVSHMEM is initialised in this process");
    m.def("nvshmem_init_with_unique_id", &moe_ep::nvshmem_init_with_unique_id,
          "initialise NVSHMEM as PE `rank`, with this module's device state");
    m.def("nvshmem_put_with_signal", &moe_ep::put_with_signal,
          "device-initiated put to a PE, then a signal there ordered after it");
    // The low-latency kernels with puts, for groups with peers that loads and stores cannot reach.
    moe_ep::bind_low_latency(m);
}
