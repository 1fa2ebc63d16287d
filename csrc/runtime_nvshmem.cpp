// NVSHMEM host-side runtime: bootstrap from a unique id (which moe_ep sends through the Buffer's
// process group), the symmetric heap, and peer pointers for ranks reachable by loads and stores.
// Without the device library (moe_ep._C) initialisation goes through nvshmemx_hostlib_init_attr, which
// returns a status where nvshmemx_init_attr would exit the process. With it (moe_ep._internode, through
// internode_runtime.cpp) the device-side calls need the device library's state set up for that module's
// statically linked code: nvshmemi_init_thread does that (it is what the inline nvshmemx_init_attr calls,
// and it returns its status instead of exiting).
#include <nvshmem.h>
#include <nvshmemx.h>

#include "runtime_nvshmem.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace moe_ep {

std::string nvshmem_version() {
    int major = 0, minor = 0, patch = 0;
    nvshmemx_vendor_get_version_info(&major, &minor, &patch);
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string nvshmem_unique_id() {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (nvshmemx_get_uniqueid(&id) != 0) throw std::runtime_error("moe_ep: nvshmemx_get_uniqueid failed");
    return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

bool nvshmem_initialized() { return nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED; }

void nvshmem_init_with_unique_id(const std::string& id_bytes, int rank, int num_ranks) {
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    if (id_bytes.size() != sizeof(id)) throw std::invalid_argument("moe_ep: not an NVSHMEM unique id");
    std::memcpy(&id, id_bytes.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr) != 0)
        throw std::runtime_error("moe_ep: nvshmemx_set_attr_uniqueid_args failed");
#ifdef MOE_EP_WITH_NVSHMEM_DEVICE
    int provided = 0;
    const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                        NVSHMEM_VENDOR_PATCH_VERSION};
    const int status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr,
                                            version);
#else
    const int status = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
#endif
    if (status != 0)
        throw std::runtime_error("moe_ep: NVSHMEM initialisation failed with status " + std::to_string(status) +
                                 " (several ranks on one GPU need MPS and the variables moe_ep.mps sets)");
}

int nvshmem_pe() { return nvshmem_my_pe(); }
int nvshmem_num_pes() { return nvshmem_n_pes(); }

// Collective: every PE allocates the same size.
int64_t nvshmem_alloc(int64_t num_bytes) {
    void* ptr = nvshmem_malloc(static_cast<size_t>(num_bytes));
    if (ptr == nullptr)
        throw std::runtime_error("moe_ep: nvshmem_malloc of " + std::to_string(num_bytes) +
                                 " bytes failed (raise NVSHMEM_SYMMETRIC_SIZE before the first Buffer)");
    return reinterpret_cast<int64_t>(ptr);
}

void nvshmem_release(int64_t ptr) { nvshmem_free(reinterpret_cast<void*>(ptr)); }

// The address of `ptr` of PE `pe` in this process, or 0 where that PE is not reachable by loads
// and stores (another host without NVLink: RDMA puts would be needed).
int64_t nvshmem_peer_pointer(int64_t ptr, int pe) { return reinterpret_cast<int64_t>(nvshmem_ptr(reinterpret_cast<void*>(ptr), pe)); }

}  // namespace moe_ep
