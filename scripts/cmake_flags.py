#!/usr/bin/env python3
"""Print the CMAKE_ARGS that build llama-cpp-python for this machine.

A default build uses -march=native, which on some virtual machines enables AMX tile
kernels the hypervisor does not allow (SIGILL at the first batched decode). So we turn
GGML_NATIVE off and switch on exactly the x86 extensions the CPU reports, never AMX.
Stdlib only: it runs before the virtual environment exists.
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys

# /proc/cpuinfo flag -> ggml CMake option
X86_FLAGS = [
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
    ("avx_vnni", "GGML_AVX_VNNI"),
]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detect_backend() -> str:
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "metal"
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=10)
        return "cuda"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def cmake_args(backend: str, flags: set[str], machine: str) -> list[str]:
    # the RPC backend on every build: `--rpc` and `tandem rpc-server` need libggml-rpc
    args: list[str] = ["-DGGML_RPC=ON"]
    if machine in ("x86_64", "AMD64", "amd64") and flags:
        args.append("-DGGML_NATIVE=OFF")
        args += [f"-D{opt}=ON" for flag, opt in X86_FLAGS if flag in flags]
    if backend == "cuda":
        args.append("-DGGML_CUDA=on")
    elif backend == "metal":
        args.append("-DGGML_METAL=on")
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["auto", "cpu", "cuda", "metal"], default="auto")
    parser.add_argument("--print-backend", action="store_true", help="print the resolved backend only")
    ns = parser.parse_args()
    backend = detect_backend() if ns.backend == "auto" else ns.backend
    if ns.print_backend:
        print(backend)
        return 0
    print(" ".join(cmake_args(backend, cpu_flags(), platform.machine())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
