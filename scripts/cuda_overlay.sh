#!/usr/bin/env bash
# Print the extra CMake arguments llama.cpp's CUDA backend needs where the CUDA toolkit is
# assembled from pip wheels (as on this workplace's machines): cuBLAS then lives in a Python
# environment (site-packages/nvidia/cu13, or nvidia/cublas for CUDA 12) with versioned
# libraries only, and the driver's libcuda.so.1 has no unversioned link nor stub for the linker.
# Links to what is found go into OVERLAY_DIR; without any libcuda the build does without the
# driver API (GGML_CUDA_NO_VMM: a plainer memory pool, the same kernels).
#
#   scripts/cuda_overlay.sh OVERLAY_DIR [PYTHON]     # prints arguments, possibly none
#   CUDA_EXTRA_ROOTS="DIR ..." scripts/cuda_overlay.sh ...   # more folders holding nvidia/
set -euo pipefail
OV="$1"
PY="${2:-python3}"
nvcc_path="$(command -v nvcc)" || { echo "Error: nvcc not found" >&2; exit 1; }
home="$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")"
libs=0
args=()
mkdir -p "$OV/include" "$OV/lib"

link_libs() {  # each library under its own name and its unversioned one (what the linker asks)
  for f in "$1"/lib*.so*; do
    [ -e "$f" ] || continue
    base="${f##*/}"
    ln -sf "$f" "$OV/lib/$base"
    ln -sf "$f" "$OV/lib/${base%%.so*}.so"
  done
}

if [ ! -f "$home/include/cublas_v2.h" ] && [ ! -f /usr/include/cublas_v2.h ]; then
  found=""
  # shellcheck disable=SC2046
  for root in $("$PY" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
      ${CUDA_EXTRA_ROOTS:-}; do
    for d in "$root/nvidia/cu13" "$root/nvidia/cublas"; do
      if [ -f "$d/include/cublas_v2.h" ]; then found="$d"; break 2; fi
    done
  done
  if [ -z "$found" ]; then
    echo "Error: no cuBLAS headers in $home/include nor in $PY's site-packages (nvidia/)" >&2
    echo "Hint: llama.cpp's CUDA backend links cuBLAS; install nvidia-cublas or a full CUDA toolkit" >&2
    exit 1
  fi
  for h in "$found"/include/*; do ln -sfn "$h" "$OV/include/"; done
  link_libs "$found/lib"
  echo "cuda_overlay: cuBLAS from $found" >&2
  args+=("-DCMAKE_CUDA_FLAGS=-I$OV/include" "-DCMAKE_CXX_FLAGS=-I$OV/include")
  libs=1
fi

if ! ls "$home"/lib64/stubs/libcuda.so "$home"/lib*/libcuda.so \
    /usr/lib/x86_64-linux-gnu/libcuda.so /usr/lib64/libcuda.so >/dev/null 2>&1; then
  drv="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')"
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib64 /usr/lib/x86_64-linux-gnu; do
    [ -z "$drv" ] && [ -e "$d/libcuda.so.1" ] && drv="$d/libcuda.so.1"
  done
  if [ -n "$drv" ]; then
    ln -sf "$drv" "$OV/lib/libcuda.so"
    echo "cuda_overlay: libcuda from $drv" >&2
    libs=1
  else
    echo "cuda_overlay: no libcuda.so anywhere: building without the driver API (GGML_CUDA_NO_VMM)" >&2
    args+=("-DGGML_CUDA_NO_VMM=ON")
  fi
fi
[ "$libs" = 1 ] && args+=("-DCMAKE_LIBRARY_PATH=$OV/lib")
echo "${args[*]}"
