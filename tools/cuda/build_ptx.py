#!/usr/bin/env python3
"""Compiles the CUDA C kernels of memmap-tensor to PTX with NVRTC, writing each `.ptx` beside
its `.cu`. Needs libnvrtc (12.x), found through NVRTC_LIB or the `nvidia-cuda-nvrtc-cu12`
wheel (`pip install nvidia-cuda-nvrtc-cu12`). No GPU is needed.

PTX for compute_70 runs on every GPU from Volta on: the driver compiles it for the GPU at
load time. Usage: tools/cuda/build_ptx.py [--check]; --check fails if a committed .ptx differs
from a fresh build.
"""
import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "crates", "memmap-tensor", "src", "cuda", "kernels")
ARCH = b"--gpu-architecture=compute_70"


def nvrtc():
    candidates = [os.environ.get("NVRTC_LIB")]
    try:
        import nvidia.cuda_nvrtc  # type: ignore

        base = os.path.dirname(nvidia.cuda_nvrtc.__file__)
        candidates += sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    candidates += ["libnvrtc.so.12", "libnvrtc.so"]
    for c in candidates:
        if c:
            try:
                return ctypes.CDLL(c)
            except OSError:
                continue
    sys.exit("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12, or set NVRTC_LIB")


def compile_ptx(lib, path):
    src = open(path, "rb").read()
    prog = ctypes.c_void_p()
    name = os.path.basename(path).encode()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None), "create")
    opts = (ctypes.c_char_p * 2)(ARCH, b"--std=c++17")
    rc = lib.nvrtcCompileProgram(prog, 2, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"{path}: compilation failed:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx), "get PTX")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value


def check(lib, rc, what):
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"nvrtc {what}: {lib.nvrtcGetErrorString(rc).decode()}")


def main():
    lib = nvrtc()
    stale = []
    for cu in sorted(glob.glob(os.path.join(KERNELS, "*.cu"))):
        ptx = compile_ptx(lib, cu)
        out = cu[:-3] + ".ptx"
        if "--check" in sys.argv:
            if not os.path.exists(out) or open(out, "rb").read() != ptx:
                stale.append(out)
        else:
            open(out, "wb").write(ptx)
            print(f"wrote {os.path.relpath(out, ROOT)} ({len(ptx)} bytes)")
    if stale:
        sys.exit("stale PTX (run tools/cuda/build_ptx.py): " + ", ".join(stale))
    if "--check" in sys.argv:
        print("the committed PTX is current")


if __name__ == "__main__":
    main()
