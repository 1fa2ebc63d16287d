// The low-latency kernels of moe_ep._internode: kernels/low_latency.cu compiled with NVSHMEM's device
// library, so that peers that loads and stores cannot reach (another host) get their rows through
// puts. moe_ep._C builds the same source without it (relocatable device code, which the device library
// needs, measured 6-25% slower on one host), and serves the groups whose peers are all mapped.
#define MOE_EP_WITH_NVSHMEM_DEVICE 1
#include "../low_latency.cu"
