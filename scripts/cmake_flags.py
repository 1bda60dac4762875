#!/usr/bin/env python3
"""Print the CMAKE_ARGS that build llama-cpp-python for this machine: runs the package's
tandem/build_flags.py (stdlib only) by its path, so it works before the virtual
environment exists (scripts/bootstrap.sh) and never imports an installed tandem."""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[0] = __file__
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "cli" / "tandem" / "build_flags.py"),
                   run_name="__main__")
