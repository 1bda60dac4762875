#!/usr/bin/env bash
# Make .gpu-bundle/: the llama-cpp-python sdist trimmed to what scripts/gpu_check.sh builds
# (about 9 MB instead of 77), plus the wheels of everything else tandem's install needs, as
# scripts/runtime_deps.py reads it from pyproject.toml (llama-cpp-python's own dependencies in
# its place, and the build requirements), with their dependencies: for the device's Python and
# platform and for this machine's python3. Run it where PyPI is reachable; carry the folder to
# the machine without network. It prints the bundle's size against the device's 64 MiB.
#
#   scripts/trim_sdist.sh                 # writes .gpu-bundle/ (kept while the list is the same)
#   scripts/trim_sdist.sh --check         # also: the wheels install offline (pip --dry-run for
#                                         # the device's Python) and the trimmed tree configures
#   scripts/trim_sdist.sh --check --python python3.12   # and install tandem with that Python
#                                         # into a fresh venv from the bundle alone (no network)
#   scripts/trim_sdist.sh --out DIR
set -euo pipefail
LLAMA_VERSION="$("$(dirname "$0")/llama_version.sh")"  # pinned in pyproject.toml
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/.gpu-bundle"
CHECK=0
CHECK_PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --check) CHECK=1; shift ;;
    --python) CHECK_PY="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
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
# the device: python3 there is 3.12 (/opt/torch/.venv, device notes); pip matches manylinux_2_N
# tags exactly, so every glibc from manylinux2014's 2.17 to Ubuntu 22.04's 2.35 is named
# (llguidance's wheels need 2.31)
DEVICE_PY=3.12
DEVICE_TAGS=(--python-version "$DEVICE_PY" --implementation cp --platform manylinux2014_x86_64)
for n in $(seq 17 35); do DEVICE_TAGS+=(--platform "manylinux_2_${n}_x86_64"); done
mapfile -t REQS < <(python3 "$ROOT/scripts/runtime_deps.py" --sdist "$SDIST" --build)
[ "${#REQS[@]}" -gt 0 ] || { echo "Error: scripts/runtime_deps.py listed nothing" >&2; exit 1; }
# the list and the Pythons it was fetched for: a new dependency in pyproject.toml fetches again
want="$(printf '%s\n' "device $DEVICE_PY" "here $(python3 -V)" "${REQS[@]}")"
if [ "$(cat "$WHEELS/.complete" 2>/dev/null)" != "$want" ]; then
  echo "trim_sdist: fetching wheels for: ${REQS[*]}" >&2
  rm -rf "$WHEELS"
  mkdir -p "$WHEELS"
  # compiled ones (numpy, msgspec, llguidance, MarkupSafe, PyYAML...) once per platform
  python3 -m pip download --quiet --only-binary :all: -d "$WHEELS" "${DEVICE_TAGS[@]}" \
    "${REQS[@]}" >&2
  python3 -m pip download --quiet --only-binary :all: -d "$WHEELS" "${REQS[@]}" >&2
  printf '%s\n' "$want" > "$WHEELS/.complete"
fi
echo "trim_sdist: $WHEELS ($(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1))" >&2
# the device takes 64 MiB a call: this bundle and the working tree that travels with it
mib() { du -cb "$@" | tail -1 | awk '{printf "%.1f", $1 / 1048576}'; }
bundle_mib="$(mib "$SDIST" "$WHEELS")"
tree_mib="$(cd "$ROOT" && git ls-files -z | du --files0-from=- -cb 2>/dev/null | tail -1 \
  | awk '{printf "%.1f", $1 / 1048576}')"
echo "trim_sdist: bundle $bundle_mib MiB (sdist + wheels) + tracked files $tree_mib MiB, of the" \
  "device's 64 MiB per call" >&2
if awk -v b="$bundle_mib" -v t="$tree_mib" 'BEGIN { exit !(b + t >= 64) }'; then
  echo "Error: the bundle does not fit the device's 64 MiB per call" >&2
  echo "Hint: see which wheels are largest (ls -S $WHEELS)" >&2
  exit 1
fi

if [ "$CHECK" = 1 ]; then
  # every requirement resolves from the bundle alone, for the device's Python and platform;
  # pip checks Requires-Python against the Python that runs it, the cp312 tags stand for it
  python3 -m pip install --quiet --dry-run --ignore-installed --no-index --find-links "$WHEELS" \
    --only-binary :all: --ignore-requires-python --target "$tmp/dry" "${DEVICE_TAGS[@]}" \
    "${REQS[@]}" >&2 \
    || { echo "trim_sdist: the wheels do not install offline on Python $DEVICE_PY" >&2; exit 1; }
  echo "trim_sdist: every requirement installs offline from the wheels on Python $DEVICE_PY" >&2
  if [ -n "$CHECK_PY" ]; then
    # what gpu_check.sh does on the device, in a venv that sees nothing else: the wheels,
    # llama-cpp-python's Python package from the sdist (no libraries: LLAMA_BUILD=OFF), tandem
    "$CHECK_PY" -m venv "$tmp/venv"
    vpy="$tmp/venv/bin/python"
    off=(--quiet --no-index --find-links "$WHEELS")
    "$vpy" -m pip install "${off[@]}" "${REQS[@]}" >&2
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$vpy" -m pip install "${off[@]}" \
      --no-deps --no-build-isolation "$SDIST" >&2
    "$vpy" -m pip install "${off[@]}" --no-deps --no-build-isolation "$ROOT" >&2
    "$vpy" -m pip check >&2
    "$vpy" "$ROOT/scripts/runtime_deps.py" --sdist "$SDIST" --build --check
    (cd "$tmp" && "$vpy" -c 'import tandem.commands.app, msgspec, llguidance, starlette, uvicorn')
    echo "trim_sdist: tandem installs offline from the bundle into a fresh" \
      "$("$vpy" -V) venv (pip check: consistent)" >&2
  fi
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
