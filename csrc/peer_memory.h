// Device memory that other processes of the host can map, through the driver's virtual-memory API
// (cuMemCreate, exported as a POSIX file descriptor). Torch-free: plain pointers and descriptors; the
// descriptors travel between processes over Unix sockets (moe_ep/backends/descriptors.py).
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_ep::peer_memory {

// One mapping of one allocation into this process: the address range and the allocation's handle.
struct Mapping {
    uint64_t address = 0;
    size_t size = 0;  // num_bytes rounded up to the allocation granularity
    uint64_t handle = 0;
};

// Whether `device` can allocate memory exported as file descriptors (virtual-memory management and
// POSIX descriptor handles), and the driver's entry points are there.
bool supported(int device);

// A zeroed allocation of at least num_bytes on `device`, mapped here with read/write access, and a new
// file descriptor that exports it (the caller closes it once the peers have theirs).
Mapping allocate(int device, size_t num_bytes, int* exported_fd);

// Maps a peer's allocation from a descriptor it exported (size: the peer's Mapping::size) for `device`.
// The descriptor stays the caller's to close.
Mapping import(int device, int fd, size_t size);

// Unmaps, frees the address range, and drops this process's reference to the allocation (the memory
// is freed once every process that mapped it has done so).
void release(const Mapping& mapping);

}  // namespace moe_ep::peer_memory
