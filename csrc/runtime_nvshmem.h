// The NVSHMEM host runtime (runtime_nvshmem.cpp) as both extension modules bind it.
#pragma once

#include <cstdint>
#include <string>

namespace moe_ep {

std::string nvshmem_version();
std::string nvshmem_unique_id();
bool nvshmem_initialized();
void nvshmem_init_with_unique_id(const std::string& id_bytes, int rank, int num_ranks);
int nvshmem_pe();
int nvshmem_num_pes();
int64_t nvshmem_alloc(int64_t num_bytes);
void nvshmem_release(int64_t ptr);
int64_t nvshmem_peer_pointer(int64_t ptr, int pe);

}  // namespace moe_ep
