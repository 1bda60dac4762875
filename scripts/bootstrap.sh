#!/usr/bin/env bash
# Create .venv, install llama-cpp-python built for this machine (cached wheel), then tandem.
#
#   scripts/bootstrap.sh                 # detect backend (cpu / cuda / metal)
#   scripts/bootstrap.sh --backend cuda  # force one
#   scripts/bootstrap.sh --test          # also install the test extras
#   CMAKE_ARGS="..." scripts/bootstrap.sh  # your own llama.cpp build flags win
#
# The wheel cache lives in $TANDEM_CACHE_DIR (default ~/.cache/tandem)/wheels/<key>, where
# key hashes the llama-cpp-python version, the CMake flags and the Python version; a second
# bootstrap with the same key skips the 6-8 minute compile.
set -euo pipefail

LLAMA_VERSION="$("$(dirname "$0")/llama_version.sh")"  # pinned in pyproject.toml
BACKEND="auto"
EXTRAS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND="$2"; shift 2 ;;
    --backend=*) BACKEND="${1#*=}"; shift ;;
    --test) EXTRAS="[test]"; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "Error: unknown option $1" >&2; echo "Hint: scripts/bootstrap.sh --help" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"

if [ ! -x "$VENV/bin/python" ]; then
  echo "tandem: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install --quiet --upgrade pip wheel >&2

RESOLVED_BACKEND="$("$PY" scripts/cmake_flags.py --backend "$BACKEND" --print-backend)"
if [ -n "${CMAKE_ARGS:-}" ]; then
  echo "tandem: using your CMAKE_ARGS" >&2
  ARGS="$CMAKE_ARGS"
else
  ARGS="$("$PY" scripts/cmake_flags.py --backend "$RESOLVED_BACKEND")"
fi
PYTAG="$("$VPY" -c 'import sys, platform; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}")')"
KEY="$(printf '%s|%s|%s' "$LLAMA_VERSION" "$ARGS" "$PYTAG" | sha256sum | cut -c1-16)"
CACHE="${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/wheels/$KEY"

installed="$("$VPY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
if [ "$installed" = "$LLAMA_VERSION" ] && [ -f "$VENV/.llama-key" ] && [ "$(cat "$VENV/.llama-key")" = "$KEY" ]; then
  echo "tandem: llama-cpp-python $LLAMA_VERSION ($RESOLVED_BACKEND) already installed" >&2
else
  if ! ls "$CACHE"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "tandem: building llama-cpp-python $LLAMA_VERSION for $RESOLVED_BACKEND (6-8 min on 2 cores, once)" >&2
    echo "tandem: CMAKE_ARGS=$ARGS" >&2
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
      "$VPY" -m pip wheel --no-deps --no-binary llama-cpp-python --wheel-dir "$tmp" \
      "llama-cpp-python==$LLAMA_VERSION" >&2
    mkdir -p "$CACHE"
    mv "$tmp"/llama_cpp_python-*.whl "$CACHE"/
    printf '%s\n' "$ARGS" > "$CACHE/CMAKE_ARGS"
  else
    echo "tandem: using cached wheel $CACHE" >&2
  fi
  "$VPY" -m pip install --quiet --force-reinstall --no-deps "$CACHE"/llama_cpp_python-*.whl >&2
  echo "$KEY" > "$VENV/.llama-key"
fi

"$VPY" -m pip install --quiet -e ".$EXTRAS" >&2
echo "tandem: ready ($RESOLVED_BACKEND). Activate with: source .venv/bin/activate" >&2
