"""moe_ep: pure Python everywhere; the CUDA extension moe_ep._C where torch has CUDA and nvcc exists, and
moe_ep._internode (the kernels across nodes, on NVSHMEM's device library: the internode kernels and the
low-latency kernels that put to peers on other hosts) where NVSHMEM is found too.

Environment:
  MOE_EP_NO_CUDA=1      install pure Python even where CUDA is present
  NVSHMEM_DIR=...       NVSHMEM install (include/, lib/); default: the nvidia-nvshmem-cu12/-cu13 wheel
  TORCH_CUDA_ARCH_LIST  overrides the default targets "8.0;9.0" (Ampere and Hopper; the kernels so far
                        use nothing Hopper-only)
  MAX_JOBS              parallel compile jobs (ninja)
  MOE_EP_TIMELINE=1     a measuring build: the low-latency kernels stamp the GPU clock at the edges of
                        their phases (python -m moe_ep.bench.ll_timeline reads it); off by default
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _say(message: str) -> None:
    print(f"moe_ep setup: {message}", file=sys.stderr)


def find_nvshmem():
    """(include_dir, lib_dir, host_library_file) or None, and the reason when None."""
    roots = []
    if os.environ.get("NVSHMEM_DIR"):
        roots.append(os.environ["NVSHMEM_DIR"])
    try:
        import nvidia.nvshmem as wheel  # nvidia-nvshmem-cu12 / -cu13 install this namespace package
        roots.extend(wheel.__path__)
    except ImportError:
        pass
    for root in roots:
        include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
        # The wheels ship libnvshmem_host.so.3 without the unversioned name, so it is linked by file.
        hosts = sorted(glob.glob(os.path.join(lib, "libnvshmem_host.so*")))
        if os.path.exists(os.path.join(include, "nvshmem.h")) and hosts and \
                os.path.exists(os.path.join(lib, "libnvshmem_device.a")):
            return (include, lib, hosts[0]), None
    if not roots:
        return None, "NVSHMEM not found (set NVSHMEM_DIR or pip install nvidia-nvshmem-cu12/-cu13)"
    return None, f"NVSHMEM incomplete under {roots} (need include/nvshmem.h, libnvshmem_host.so*, libnvshmem_device.a)"


def cuda_extension():
    """The extension and build command, or (None, why not)."""
    if os.environ.get("MOE_EP_NO_CUDA") == "1":
        return None, "MOE_EP_NO_CUDA=1"
    try:
        import torch
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return None, "torch is not installed yet (install torch first, then moe_ep with --no-build-isolation)"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return None, "nvcc not found (set CUDA_HOME)"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(CUDA_HOME, "include", "cccl")]
    # The intranode kernels, one file per kernel family: every file there is built.
    intranode = sorted(glob.glob("csrc/kernels/intranode/*.cu", root_dir=ROOT))
    sources = ["csrc/bindings.cpp", "csrc/peer_memory.cpp", "csrc/kernels/layout.cu", "csrc/kernels/fp8.cu",
               *intranode, "csrc/kernels/low_latency.cu", "csrc/kernels/traffic.cu"]
    define_macros, libraries, extra_link = [], [], []
    if "9.0" in os.environ["TORCH_CUDA_ARCH_LIST"]:
        define_macros.append(("MOE_EP_SM90_COMPILED", "1"))
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-Xptxas=-v" if os.environ.get("MOE_EP_PTXAS_V") else "-lineinfo"]
    if os.environ.get("MOE_EP_TIMELINE") == "1":  # a measuring build: the low-latency kernels stamp their phases
        define_macros.append(("MOE_EP_TIMELINE", "1"))
    nvshmem, nvshmem_reason = find_nvshmem()
    if nvshmem is not None:
        include, lib, host_library = nvshmem
        include_dirs.append(include)
        define_macros.append(("MOE_EP_WITH_NVSHMEM", "1"))
        extra_link += [host_library, f"-Wl,-rpath,{lib}"]
        sources.append("csrc/runtime_nvshmem.cpp")
        _say(f"NVSHMEM from {lib}")
    else:
        define_macros.append(("MOE_EP_NVSHMEM_REASON", f'"{nvshmem_reason}"'))
        _say(f"building without NVSHMEM: {nvshmem_reason}; the internode kernels and low-latency calls across "
             "hosts are left out")
    ext = CUDAExtension(
        "moe_ep._C", sources, include_dirs=include_dirs, define_macros=define_macros, libraries=libraries,
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags}, extra_link_args=extra_link)
    extensions = [ext]
    if nvshmem is not None:
        extensions.append(internode_extension(nvshmem, include_dirs[:2], nvcc_flags[:3], define_macros))
    return (extensions, BuildExtension.with_options(use_ninja=True)), None


def internode_extension(nvshmem, include_dirs, nvcc_flags, define_macros):
    """moe_ep._internode: NVSHMEM's device calls need relocatable device code (-rdc) and a device link
    against its static library, which would cost the intranode and low-latency kernels of moe_ep._C if they
    shared the module (relocatable low-latency kernels measured 6-25% slower in device time on one host,
    `moe-ep-bench low_latency --ranks 8 --graph`). So the low-latency kernels are built twice: in moe_ep._C
    for peers that loads and stores reach, here with puts for peers on other hosts."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, CUDAExtension

    include, lib, host_library = nvshmem
    # torch builds extensions without the half/bf16 operators, which NVSHMEM's device headers use.
    nvshmem_flags = [f"-U{flag[2:]}" for flag in COMMON_NVCC_FLAGS if flag.startswith("-D__CUDA_NO_")]
    return CUDAExtension(
        "moe_ep._internode",
        ["csrc/internode_bindings.cpp", "csrc/internode_runtime.cpp", "csrc/kernels/internode/kernels.cu",
         "csrc/kernels/internode/low_latency_puts.cu", "csrc/kernels/internode/nvshmem_puts.cu"],
        include_dirs=[*include_dirs, include],
        # The low-latency kernels' build options (a timeline build, the Hopper paths), not NVSHMEM's.
        define_macros=[m for m in define_macros if "NVSHMEM" not in m[0]],
        extra_compile_args={"cxx": ["-O3"], "nvcc": [*nvcc_flags, "-rdc=true", *nvshmem_flags]},
        extra_link_args=[os.path.join(lib, "libnvshmem_device.a"), host_library, f"-Wl,-rpath,{lib}"],
        dlink=True, dlink_libraries=["nvshmem_device"], library_dirs=[lib])


built, reason = cuda_extension()
if built is None:
    _say(f"installing pure Python (portable backend only): {reason}")
ext_modules = built[0] if built else []
cmdclass = {"build_ext": built[1]} if built else {}

setup(
    name="moe_ep",
    version="0.1.0",
    description="Expert-parallel dispatch/combine for Mixture-of-Experts, call-compatible with deep_ep.Buffer",
    packages=find_packages(include=["moe_ep", "moe_ep.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    extras_require={
        "test": ["pytest>=7", "numpy"],
        "demo": ["rich"],
        "bench": ["tqdm", "matplotlib"],  # the benchmarks' progress bars and --plot (both optional)
        "cuda": ["pybind11", "ninja"],
    },
    entry_points={"console_scripts": ["moe-ep-bench = moe_ep.bench.__main__:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
