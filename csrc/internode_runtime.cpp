// The NVSHMEM runtime of moe_ep._internode: runtime_nvshmem.cpp compiled with the device library's
// initialisation (a file of its own: moe_ep._C compiles the same source without it, and the two builds
// must not share an object file).
#define MOE_EP_WITH_NVSHMEM_DEVICE 1
#include "runtime_nvshmem.cpp"
