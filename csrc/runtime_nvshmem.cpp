// NVSHMEM host-side runtime pieces. Linking the host library here proves at import time that the
// rpath to the nvidia-nvshmem wheel works; the low-latency and internode kernels build on it.
#include <nvshmem.h>

#include <string>

namespace moe_ep {

std::string nvshmem_version() {
    int major = 0, minor = 0, patch = 0;
    nvshmemx_vendor_get_version_info(&major, &minor, &patch);
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

}  // namespace moe_ep
