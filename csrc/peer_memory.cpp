// Peer-mappable memory through the driver's virtual-memory API. Why not CUDA IPC handles: with 8 ranks
// on one H200, rows stored into peers' buffers opened with cudaIpcOpenMemHandle ran at 60-65% of the
// rate of the same stores into buffers mapped this way (the one-pass fp8 dispatch 153-159 -> 254 GB/s
// per rank, the windowed bf16 dispatch 93-105 -> 153-157; `moe-ep-bench intranode --ranks 8 --peer-memory
// ipc` against `--peer-memory vmm`).
#include "peer_memory.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace moe_ep::peer_memory {
namespace {

// The driver's entry points, found through the runtime so the extension needs no link to libcuda.
struct Driver {
    PFN_cuDeviceGetAttribute_v2000 device_attribute = nullptr;
    PFN_cuGetErrorString_v6000 error_string = nullptr;
    PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
    PFN_cuMemCreate_v10020 create = nullptr;
    PFN_cuMemRelease_v10020 release = nullptr;
    PFN_cuMemAddressReserve_v10020 reserve = nullptr;
    PFN_cuMemAddressFree_v10020 address_free = nullptr;
    PFN_cuMemMap_v10020 map = nullptr;
    PFN_cuMemUnmap_v10020 unmap = nullptr;
    PFN_cuMemSetAccess_v10020 set_access = nullptr;
    PFN_cuMemExportToShareableHandle_v10020 export_handle = nullptr;
    PFN_cuMemImportFromShareableHandle_v10020 import_handle = nullptr;
    bool complete = false;
};

template <typename Fn>
bool find(const char* symbol, unsigned int version, Fn* fn) {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t status =
        cudaGetDriverEntryPointByVersion(symbol, &address, version, cudaEnableDefault, &found);
#else
    (void)version;
    const cudaError_t status = cudaGetDriverEntryPoint(symbol, &address, cudaEnableDefault, &found);
#endif
    *fn = reinterpret_cast<Fn>(address);
    return status == cudaSuccess && found == cudaDriverEntryPointSuccess && address != nullptr;
}

const Driver& driver() {
    static const Driver d = [] {
        Driver x;
        x.complete = find("cuDeviceGetAttribute", 2000, &x.device_attribute) &&
                     find("cuGetErrorString", 6000, &x.error_string) &&
                     find("cuMemGetAllocationGranularity", 10020, &x.granularity) &&
                     find("cuMemCreate", 10020, &x.create) && find("cuMemRelease", 10020, &x.release) &&
                     find("cuMemAddressReserve", 10020, &x.reserve) &&
                     find("cuMemAddressFree", 10020, &x.address_free) && find("cuMemMap", 10020, &x.map) &&
                     find("cuMemUnmap", 10020, &x.unmap) && find("cuMemSetAccess", 10020, &x.set_access) &&
                     find("cuMemExportToShareableHandle", 10020, &x.export_handle) &&
                     find("cuMemImportFromShareableHandle", 10020, &x.import_handle);
        return x;
    }();
    if (!d.complete) throw std::runtime_error("peer memory: the CUDA driver lacks the virtual-memory API");
    return d;
}

void check(CUresult result, const char* what) {
    if (result == CUDA_SUCCESS) return;
    const char* text = nullptr;
    driver().error_string(result, &text);
    throw std::runtime_error(std::string("peer memory: ") + what + " failed: " + (text ? text : "unknown error"));
}

void check(cudaError_t result, const char* what) {
    if (result != cudaSuccess)
        throw std::runtime_error(std::string("peer memory: ") + what + " failed: " + cudaGetErrorString(result));
}

CUmemAllocationProp properties(int device) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return prop;
}

// Reserves an address range for `handle` (size bytes), maps it and gives `device` read/write access;
// on failure nothing stays reserved or mapped.
uint64_t map_here(int device, CUmemGenericAllocationHandle handle, size_t size, size_t alignment) {
    const Driver& d = driver();
    CUdeviceptr address = 0;
    check(d.reserve(&address, size, alignment, 0, 0), "cuMemAddressReserve");
    CUresult mapped = d.map(address, size, 0, handle, 0);
    if (mapped == CUDA_SUCCESS) {
        CUmemAccessDesc access{};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        const CUresult allowed = d.set_access(address, size, &access, 1);
        if (allowed == CUDA_SUCCESS) return static_cast<uint64_t>(address);
        d.unmap(address, size);
        mapped = allowed;
    }
    d.address_free(address, size);
    check(mapped, "mapping the allocation (cuMemMap, cuMemSetAccess)");
    return 0;
}

size_t granule(int device) {
    const CUmemAllocationProp prop = properties(device);
    size_t g = 0;
    check(driver().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
    return g;
}

}  // namespace

bool supported(int device) {
    try {
        const Driver& d = driver();
        int vmm = 0, descriptors = 0;
        const auto vmm_attribute = CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        const auto fd_attribute = CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
        return d.device_attribute(&vmm, vmm_attribute, device) == CUDA_SUCCESS &&
               d.device_attribute(&descriptors, fd_attribute, device) == CUDA_SUCCESS && vmm != 0 && descriptors != 0;
    } catch (const std::runtime_error&) {
        return false;
    }
}

Mapping allocate(int device, size_t num_bytes, int* exported_fd) {
    const Driver& d = driver();
    const size_t g = granule(device);
    Mapping m;
    m.size = (num_bytes + g - 1) / g * g;
    const CUmemAllocationProp prop = properties(device);
    CUmemGenericAllocationHandle handle = 0;
    check(d.create(&handle, m.size, &prop, 0), "cuMemCreate");
    m.handle = handle;
    try {
        m.address = map_here(device, handle, m.size, g);
    } catch (...) {
        d.release(handle);
        throw;
    }
    try {
        // Zeroed before any peer can see it (the kernels' flags start at 0).
        check(cudaMemset(reinterpret_cast<void*>(m.address), 0, m.size), "zeroing the allocation");
        check(cudaDeviceSynchronize(), "zeroing the allocation");
        int fd = -1;
        check(d.export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              "cuMemExportToShareableHandle");
        *exported_fd = fd;
    } catch (...) {
        release(m);
        throw;
    }
    return m;
}

Mapping import(int device, int fd, size_t size) {
    const Driver& d = driver();
    Mapping m;
    m.size = size;
    CUmemGenericAllocationHandle handle = 0;
    check(d.import_handle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
    m.handle = handle;
    try {
        m.address = map_here(device, handle, size, granule(device));
    } catch (...) {
        d.release(handle);
        throw;
    }
    return m;
}

void release(const Mapping& mapping) {
    const Driver& d = driver();
    const auto address = static_cast<CUdeviceptr>(mapping.address);
    check(d.unmap(address, mapping.size), "cuMemUnmap");
    check(d.address_free(address, mapping.size), "cuMemAddressFree");
    check(d.release(static_cast<CUmemGenericAllocationHandle>(mapping.handle)), "cuMemRelease");
}

}  // namespace moe_ep::peer_memory
