"""The CMake flags that build llama-cpp-python (and llama.cpp's tools) for this machine, and
the one command that rebuilds it with them: what error hints tell a user to run.

A default build uses -march=native, which on some virtual machines enables AMX tile kernels
the hypervisor does not allow (SIGILL at the first batched decode). So GGML_NATIVE is off
and exactly the x86 extensions the CPU reports are on, never AMX. Stdlib only, importing
nothing of tandem: scripts/bootstrap.sh runs it (through scripts/cmake_flags.py) before the
virtual environment exists.
"""
from __future__ import annotations

import argparse
import platform
import re
import shlex
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
BACKENDS = ("cpu", "cuda", "metal")


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


def llama_requirement() -> str:
    """llama-cpp-python as tandem pins it (its installed metadata: pyproject.toml's pin)."""
    from importlib import metadata

    try:
        requires = metadata.requires("tandem") or []
    except metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        if re.match(r"llama[-_]cpp[-_]python\b", req, re.IGNORECASE) and "extra ==" not in req:
            return req.split(";")[0].replace(" ", "")
    return "llama-cpp-python"


def rebuild_command(backend: str | None = None) -> str:
    """The shell command that builds the pinned llama-cpp-python from source for this
    machine (`backend`: cpu, cuda or metal; None: the one detected), in the environment
    tandem runs in: pip, which any install of tandem has."""
    backend = backend or detect_backend()
    args = " ".join(cmake_args(backend, cpu_flags(), platform.machine()))
    return (f"CMAKE_ARGS={shlex.quote(args)} {shlex.quote(sys.executable)} -m pip install "
            f"--force-reinstall --no-cache-dir --no-binary llama-cpp-python "
            f"{shlex.quote(llama_requirement())}")


def rebuild_hint(backend: str | None = None, why: str = "") -> str:
    """A hint to rebuild llama-cpp-python (`why`: what the build must have, said first)."""
    lead = f"rebuild llama-cpp-python for this machine{f' ({why})' if why else ''}"
    return f"{lead}: {rebuild_command(backend)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("auto",) + BACKENDS, default="auto")
    parser.add_argument("--print-backend", action="store_true",
                        help="print the resolved backend only")
    ns = parser.parse_args(argv)
    backend = detect_backend() if ns.backend == "auto" else ns.backend
    if ns.print_backend:
        print(backend)
        return 0
    print(" ".join(cmake_args(backend, cpu_flags(), platform.machine())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
