#!/usr/bin/env bash
# Prints the pinned llama-cpp-python version: pyproject.toml is the one place it is written;
# the shell scripts (bootstrap, build_native, trim_sdist, gpu_check) read it from here.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
version="$(sed -n 's/^ *"llama-cpp-python==\([0-9][0-9.]*\)",* *$/\1/p' "$ROOT/pyproject.toml")"
if [ -z "$version" ]; then
  echo "Error: no llama-cpp-python==X.Y.Z pin in $ROOT/pyproject.toml" >&2
  exit 1
fi
echo "$version"
