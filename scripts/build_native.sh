#!/usr/bin/env bash
# Build llama.cpp's native tools (llama-speculative-simple, llama-bench, llama-simple, llama-server,
# llama-completion: plain decoding with a thread count, llama-quantize: synthetic GGUFs,
# ggml-rpc-server: llama.cpp's own RPC server, needs -DGGML_RPC=ON as in cmake_flags.py)
# from the llama.cpp source that the pinned llama-cpp-python sdist vendors, with the same CMake
# flags as our wheel, so benchmarks compare tandem against the very same kernels.
#   scripts/build_native.sh            # prints the bin directory on stdout
#   scripts/build_native.sh --dir      # the same, without building: exit 1 if not built yet
set -euo pipefail
LLAMA_VERSION="$("$(dirname "$0")/llama_version.sh")"  # pinned in pyproject.toml
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ARGS="${CMAKE_ARGS:-$(python3 "$ROOT/scripts/cmake_flags.py")}"
KEY="$(printf '%s|%s' "$LLAMA_VERSION" "$ARGS" | sha256sum | cut -c1-16)"
OUT="${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/native/$KEY"
TARGETS="llama-speculative-simple llama-bench llama-simple llama-server llama-completion llama-quantize ggml-rpc-server"
built=1
for t in $TARGETS; do [ -x "$OUT/bin/$t" ] || built=0; done
if [ "$built" = 1 ]; then
  echo "$OUT/bin"; exit 0
fi
if [ "${1:-}" = "--dir" ]; then
  echo "$OUT/bin"; exit 1
fi
mkdir -p "$OUT"
if [ ! -d "$OUT/src" ]; then
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_VERSION" >&2
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$OUT/src"
  rm -rf "$tmp"
fi
echo "building native llama.cpp tools ($ARGS)" >&2
# shellcheck disable=SC2086
cmake -S "$OUT/src" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON $ARGS >&2
cmake --build "$OUT/build" --config Release -j "$(nproc)" --target $TARGETS >&2
mkdir -p "$OUT/bin"
for t in $TARGETS; do cp "$OUT/build/bin/$t" "$OUT/bin/"; done
echo "$OUT/bin"
