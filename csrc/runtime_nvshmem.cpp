// NVSHMEM host-side runtime pieces. Linking the host library here proves at import time that the
// rpath to the nvidia-nvshmem wheel works; the low-latency and internode kernels build on it.
#include <nvshmem.h>

#include <string>

namespace moe_ep {

std::string nvshmem_version() {
    int major = 0, minor = 0;
    nvshmem_info_get_version(&major, &minor);
    return std::to_string(major) + "." + std::to_string(minor);
}

}  // namespace moe_ep
