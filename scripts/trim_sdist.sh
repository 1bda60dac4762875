#!/usr/bin/env bash
# Make .gpu-bundle/: the llama-cpp-python sdist trimmed to what scripts/gpu_check.sh builds
# (about 10 MB instead of 77), plus the wheels llama_cpp imports that a bare GPU machine may
# lack (jinja2, MarkupSafe, diskcache, typing_extensions) and setuptools for tandem's own
# install. Run it where PyPI is reachable; carry the folder to the machine without network.
#
#   scripts/trim_sdist.sh                 # writes .gpu-bundle/ (kept if already complete)
#   scripts/trim_sdist.sh --check         # also configure the trimmed tree with CMake (no build)
#   scripts/trim_sdist.sh --out DIR
set -euo pipefail
LLAMA_VERSION="$("$(dirname "$0")/llama_version.sh")"  # pinned in pyproject.toml
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/.gpu-bundle"
CHECK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --check) CHECK=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "Error: unknown option $1" >&2; echo "Hint: scripts/trim_sdist.sh --help" >&2; exit 2 ;;
  esac
done
SDIST="$OUT/llama_cpp_python-$LLAMA_VERSION-trimmed.tar.gz"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [ ! -f "$SDIST" ]; then
  echo "trim_sdist: downloading llama-cpp-python $LLAMA_VERSION (sdist)" >&2
  python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp/dl" \
    "llama-cpp-python==$LLAMA_VERSION" >&2
  tar -xzf "$tmp"/dl/llama_cpp_python-*.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-$LLAMA_VERSION"
  v="$src/vendor/llama.cpp"
  # model files, documentation, web UI assets, benchmark results and images: nothing builds them
  rm -rf "$v/models" "$v/docs" "$v/tools/ui" "$v/media" "$v/benches" "$v/.github" "$v/.devops" \
    "$src/docs" "$src/examples" "$src/docker"
  find "$src" -name .git -prune -exec rm -rf {} +
  # of the examples, the two tools gpu_check runs; their CMakeLists would add all the others
  find "$v/examples" -mindepth 1 -maxdepth 1 ! -name simple ! -name speculative-simple \
    -exec rm -rf {} +
  cat > "$v/examples/CMakeLists.txt" <<'EOF'
# trimmed by tandem's scripts/trim_sdist.sh to the examples scripts/gpu_check.sh builds
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(simple)
add_subdirectory(speculative-simple)
EOF
  mkdir -p "$OUT"
  tar -czf "$SDIST.part" -C "$tmp" "llama_cpp_python-$LLAMA_VERSION"
  mv "$SDIST.part" "$SDIST"
fi
echo "trim_sdist: $SDIST ($(du -h "$SDIST" | cut -f1))" >&2

WHEELS="$OUT/wheels"
if [ ! -f "$WHEELS/.complete" ]; then
  mkdir -p "$WHEELS"
  python3 -m pip download --quiet --only-binary :all: --no-deps -d "$WHEELS" \
    "jinja2>=3.1" "diskcache>=5.6.1" "typing_extensions>=4.5" "setuptools>=68" >&2
  # MarkupSafe (jinja2's one dependency) is compiled: one wheel per Python and platform
  for py in 3.10 3.11 3.12 3.13 3.14; do
    for plat in manylinux2014_x86_64 manylinux2014_aarch64; do
      python3 -m pip download --quiet --only-binary :all: --no-deps -d "$WHEELS" \
        --python-version "$py" --platform "$plat" "markupsafe>=2.0" >&2
    done
  done
  touch "$WHEELS/.complete"
fi
echo "trim_sdist: $WHEELS ($(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1))" >&2

if [ "$CHECK" = 1 ]; then
  # the trimmed tree must still configure with every target gpu_check.sh builds
  tar -xzf "$SDIST" -C "$tmp"
  # shellcheck disable=SC2046
  cmake -S "$tmp/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp" -B "$tmp/cfg" \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    $(python3 "$ROOT/scripts/cmake_flags.py" --backend cpu) >"$tmp/cfg.log" 2>&1 \
    || { tail -30 "$tmp/cfg.log" >&2; exit 1; }
  targets="$(cmake --build "$tmp/cfg" --target help)"
  for t in llama llama-speculative-simple llama-bench llama-completion llama-quantize; do
    grep -qE "(^|[ /:])$t(:|$| )" <<<"$targets" || { echo "trim_sdist: no target $t" >&2; exit 1; }
  done
  echo "trim_sdist: the trimmed tree configures, with every target gpu_check.sh builds" >&2
fi
echo "$OUT"
