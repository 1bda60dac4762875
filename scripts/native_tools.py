"""llama.cpp's own tools (llama-server, llama-bench, llama-speculative-simple...), built by
scripts/build_native.sh from the source the pinned llama-cpp-python vendors, with our CMake
flags: the one place the benchmark scripts find or build them (the build folder is the shell
script's to compute, so it is computed once). A checkout's: the build script lives beside it.

  from native_tools import native_bin     # in a script of this folder
  server = native_bin() / "llama-server"
"""
from __future__ import annotations

import subprocess
from pathlib import Path

BUILD = Path(__file__).resolve().parent / "build_native.sh"


def native_bin(build: bool = True) -> Path | None:
    """The tools' directory; built first when `build` (minutes on a CPU, once), else None
    when they are not built yet."""
    res = subprocess.run([str(BUILD)] + ([] if build else ["--dir"]), capture_output=True,
                         text=True)
    if res.returncode != 0:
        if not build:
            return None
        raise SystemExit(f"Error: scripts/build_native.sh failed:\n{res.stderr[-2000:]}")
    return Path(res.stdout.strip().splitlines()[-1])
