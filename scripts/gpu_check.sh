#!/usr/bin/env bash
# One call on a CUDA machine without network: build llama.cpp with CUDA from the trimmed
# llama-cpp-python sdist (.gpu-bundle/, made by scripts/trim_sdist.sh), install
# llama-cpp-python on those libraries, tandem's dependencies (scripts/runtime_deps.py: those of
# pyproject.toml) from the bundle's wheels and tandem into a venv that sees the system's
# packages, then make shape-matched synthetic models and measure them (scripts/gpu_check.py):
# one JSON. Exit status 1 when a package is missing or a section erred (each named on stderr).
#
#   scripts/gpu_check.sh --out "$OUT/gpu_check.json"              # CUDA, shapes 0.5b,1.5b,7b
#   scripts/gpu_check.sh --cpu --shapes tiny --out /tmp/gc.json   # CPU: cached native build
#   scripts/gpu_check.sh --deadline-s 540 -- --pair-reps 2        # after --: gpu_check.py's
#
# llama.cpp is built once, with the CMake flags of scripts/cmake_flags.py plus
# -DCMAKE_CUDA_ARCHITECTURES=native, into .gpu-check/build-<key> (key: version and flags);
# the tools gpu_check.py runs come from that build, and llama-cpp-python's Python package is
# installed with LLAMA_BUILD=OFF and given the same libraries, so the CUDA kernels compile once
# (the longest step) instead of twice. A second call after a timeout resumes where it stopped.
# --cpu takes the libraries and tools of scripts/build_native.sh (cached; same flags as our
# wheel) instead of compiling. Results on stdout and in --out (default $OUT/gpu_check.json);
# the build's log in $OUT/gpu_check_build.log where $OUT is set, else .gpu-check/build.log.
set -euo pipefail
LLAMA_VERSION="$("$(dirname "$0")/llama_version.sh")"  # pinned in pyproject.toml
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
T0=$SECONDS
BACKEND="cuda"
BUNDLE="$ROOT/.gpu-bundle"
OUT_FILE="${OUT:+$OUT/gpu_check.json}"
OUT_FILE="${OUT_FILE:-$ROOT/gpu_check.json}"
SHAPES=""
DEADLINE=0
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) BACKEND="cpu"; shift ;;
    --out) OUT_FILE="$2"; shift 2 ;;
    --shapes) SHAPES="$2"; shift 2 ;;
    --bundle) BUNDLE="$2"; shift 2 ;;
    --deadline-s) DEADLINE="$2"; shift 2 ;;
    --) shift; PASS=("$@"); break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "Error: unknown option $1" >&2; echo "Hint: scripts/gpu_check.sh --help" >&2; exit 2 ;;
  esac
done
STATE="$ROOT/.gpu-check"
mkdir -p "$STATE"
# the build's log lands in $OUT where there is one: a remote run cut short still returns it
LOG="${OUT:+$OUT/gpu_check_build.log}"
LOG="${LOG:-$STATE/build.log}"
say() { echo "gpu_check.sh: $*" >&2; }
fail() { echo "Error: $1" >&2; [ -n "${2:-}" ] && echo "Hint: $2" >&2; exit 1; }
PY="${PYTHON:-python3}"

if [ "$BACKEND" = cuda ] && [ -z "${CUDA_ARCH:-}" ] && ! command -v nvidia-smi >/dev/null; then
  fail "nvidia-smi not found: no CUDA GPU here" \
    "on a machine without a GPU run scripts/gpu_check.sh --cpu --shapes tiny"
fi
SDIST="$BUNDLE/llama_cpp_python-$LLAMA_VERSION-trimmed.tar.gz"
if [ ! -f "$SDIST" ]; then
  [ "$BACKEND" = cpu ] || fail "no $SDIST" \
    "run scripts/trim_sdist.sh where PyPI is reachable and carry .gpu-bundle/ to this machine"
  scripts/trim_sdist.sh --out "$BUNDLE" >/dev/null
fi
SRC="$STATE/llama_cpp_python-$LLAMA_VERSION"
if [ ! -d "$SRC" ]; then
  tar -xzf "$SDIST" -C "$STATE"
fi

# ---- llama.cpp: libraries and tools
if [ -n "${CMAKE_ARGS:-}" ]; then
  ARGS="$CMAKE_ARGS"
else
  ARGS="$("$PY" scripts/cmake_flags.py --backend "$BACKEND")"
fi
if [ "$BACKEND" = cuda ]; then
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  # CUDA_ARCH: for a build on a machine without the GPU (native needs one to look at)
  ARGS="$ARGS -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}"
  ARGS="$ARGS $(scripts/cuda_overlay.sh "$STATE/cuda-overlay" "$PY")"
fi
build_s=0
if [ "$BACKEND" = cpu ]; then
  BIN_DIR="$(scripts/build_native.sh)"
  LIB_DIR="$(dirname "$BIN_DIR")/build/bin"
  reused=true
else
  KEY="$(printf '%s|%s' "$LLAMA_VERSION" "$ARGS" | sha256sum | cut -c1-16)"
  BUILD="$STATE/build-$KEY"
  TARGETS="llama llama-speculative-simple llama-bench llama-completion llama-quantize"
  reused=true
  for t in $TARGETS; do [ "$t" = llama ] || [ -x "$BUILD/bin/$t" ] || reused=false; done
  if [ "$reused" = false ]; then
    say "building llama.cpp ($ARGS) into $BUILD; log: $LOG"
    gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
    t_build=$SECONDS
    # shellcheck disable=SC2086
    { cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF $ARGS \
      && cmake --build "$BUILD" --config Release -j "$(nproc)" --target $TARGETS; } \
      >>"$LOG" 2>&1 || { tail -40 "$LOG" >&2; fail "the llama.cpp build failed" \
        "see $LOG; a rerun resumes the build"; }
    build_s=$((SECONDS - t_build))
  fi
  BIN_DIR="$BUILD/bin"
  LIB_DIR="$BUILD/bin"
fi
say "llama.cpp tools and libraries: $BIN_DIR"

# ---- venv: the system's packages where they fit, llama-cpp-python, tandem
VENV="$STATE/venv-$BACKEND"
# without ensurepip (a distribution's python3 without its venv package) the venv runs the
# system's pip, which the system site-packages make importable
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV" 2>/dev/null \
  || { rm -rf "$VENV"; "$PY" -m venv --system-site-packages --without-pip "$VENV"; }
VPY="$VENV/bin/python"
# a python3 that is itself a venv (on the GPU machine: the one holding PyTorch and numpy)
# would hide its packages from --system-site-packages, which sees only the base install
parent="$("$PY" -c 'import sys, site; print(" ".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')"
if [ -n "$parent" ]; then
  own="$("$VPY" -c 'import site; print(site.getsitepackages()[0])')"
  printf '%s\n' $parent > "$own/gpu_check_parent.pth"
fi
# what tandem needs, as pyproject.toml lists it (scripts/runtime_deps.py; llama-cpp-python's own
# dependencies in its place, since it is installed from the sdist below, and the build
# requirements); the bundle's wheels first, PyPI only where there is a network (the CPU path)
DEPS=(scripts/runtime_deps.py --sdist "$SDIST" --build)
mapfile -t REQS < <("$PY" "${DEPS[@]}")
[ "${#REQS[@]}" -gt 0 ] || fail "scripts/runtime_deps.py listed nothing" "run it to see why"
if ! "$VPY" "${DEPS[@]}" --check 2>/dev/null; then
  say "installing ${REQS[*]}"
  "$VPY" -m pip install --quiet --no-index --find-links "$BUNDLE/wheels" "${REQS[@]}" >&2 \
    2>/dev/null || { [ "$BACKEND" = cpu ] && "$VPY" -m pip install --quiet "${REQS[@]}" >&2; } \
    || true  # the check below names what is still missing
  "$VPY" "${DEPS[@]}" --check || fail "python packages that tandem needs are missing (above)" \
    "run scripts/trim_sdist.sh where PyPI is reachable and carry .gpu-bundle/ here"
fi
LIBKEY="$LLAMA_VERSION|$LIB_DIR"
if [ "$(cat "$VENV/.llama-libs" 2>/dev/null)" != "$LIBKEY" ]; then
  say "installing llama-cpp-python $LLAMA_VERSION (Python package, libraries from $LIB_DIR)"
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$VPY" -m pip install --quiet --no-deps \
    --no-build-isolation --no-index --force-reinstall "$SDIST" >&2
  PKG="$("$VPY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("llama_cpp").origin))')"
  mkdir -p "$PKG/lib"
  cp -a "$LIB_DIR"/lib*.so* "$PKG/lib/"
  echo "$LIBKEY" > "$VENV/.llama-libs"
fi
if ! "$VPY" -c 'import tandem' 2>/dev/null \
  && ! "$VPY" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" >&2; then
  say "tandem could not be installed (see above): running it from $ROOT/cli"
  export PYTHONPATH="$ROOT/cli${PYTHONPATH:+:$PYTHONPATH}"
fi
"$VPY" -c 'import gguf' 2>/dev/null || export PYTHONPATH="$SRC/vendor/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
offload="$("$VPY" -c 'from tandem.engine.backend.llama import supports_gpu_offload as s; print(s())')"
if [ "$BACKEND" = cuda ] && [ "$offload" != True ]; then
  fail "llama.cpp was built but offers no GPU offload" "see $LOG for GGML_CUDA"
fi

# ---- measure
cat > "$STATE/build-info.json" <<EOF
{"backend": "$BACKEND", "cmake_args": "$ARGS", "reused_build": $reused, "build_seconds": $build_s,
 "lib_dir": "$LIB_DIR", "nvcc": "$(nvcc --version 2>/dev/null | tail -1 | tr -d '"')",
 "cmake": "$(cmake --version | head -1)", "setup_seconds": $((SECONDS - T0))}
EOF
extra=()
[ -n "$SHAPES" ] && extra+=(--shapes "$SHAPES")
if [ "$DEADLINE" != 0 ]; then extra+=(--deadline-s "$((DEADLINE - (SECONDS - T0)))"); fi
"$VPY" scripts/gpu_check.py --bin-dir "$BIN_DIR" --backend "$BACKEND" --out "$OUT_FILE" \
  --build-info "$STATE/build-info.json" "${extra[@]}" "${PASS[@]}"
