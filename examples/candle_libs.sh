#!/usr/bin/env bash
# What candle-core's `cuda` feature links and pinstream's toolkit lacks. cudarc, built with the
# `dynamic-linking` feature that candle turns on, links libcuda, libcublas, libcublasLt, libcurand
# and libnvrtc by their unversioned names. This installs the CUDA 13.0 libraries from PyPI into
# the pinstream cache (`candle-libs-13.0`, 915 MB on disk), links the unversioned names to them,
# and makes a stub libcuda.so: the driver's library is in no package registry, and the stub only
# satisfies the linker (the program loads the driver's libcuda.so.1 at run time). Then it writes
# env.sh there: pinstream's toolkit env file plus LIBRARY_PATH (linking) and LD_LIBRARY_PATH
# (running).
#
#   examples/candle_libs.sh [TOOLKIT_ENV_FILE]   # default: what `--example toolkit_env` names
#   . ~/.cache/pinstream/candle-libs-13.0/env.sh
#   cargo run --release --example to_candle --features candle
set -euo pipefail
cd "$(dirname "$0")/.."
toolkit_env=${1:-$(cargo run -q --example toolkit_env | sed -n '1s/^# //p')}
[ -f "$toolkit_env" ] || { echo "no toolkit env file: $toolkit_env" >&2; exit 1; }
cache=${PINSTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pinstream}
dest=$cache/candle-libs-13.0
pins=(nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88)

if [ ! -d "$dest" ]; then
    tmp=$cache/.candle-libs-13.0.tmp-$$
    rm -rf "$tmp"
    "${PINSTREAM_PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check \
        --no-warn-script-location --no-compile --no-deps --target "$tmp" "${pins[@]}"
    mkdir -p "$tmp/link"
    for lib in cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
        ln -s "../nvidia/cu13/lib/lib$lib" "$tmp/link/lib${lib%%.so*}.so"
    done
    # Every driver entry point cudarc declares, as an empty function: enough for the linker.
    cudarc=$(cargo metadata --format-version 1 --features candle |
        "${PINSTREAM_PYTHON:-python3}" -c 'import json,sys
print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')
    grep -o '^pub unsafe fn cu[A-Za-z0-9_]*' "$(dirname "$cudarc")/src/driver/sys/mod.rs" |
        sed 's/^pub unsafe fn \(.*\)/void \1(void) {}/' | sort -u >"$tmp/link/cuda_stub.c"
    "${CC:-cc}" -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tmp/link/libcuda.so" "$tmp/link/cuda_stub.c"
    mv -T "$tmp" "$dest" 2>/dev/null || rm -rf "$tmp" # another run finished first: keep its copy
fi
cat >"$dest/env.sh" <<EOF
# Written by pinstream's examples/candle_libs.sh: the toolkit pinstream built with, and the
# libraries candle-core's \`cuda\` feature links. Source it before building or running.
. '$toolkit_env'
export LIBRARY_PATH='$dest/link'"\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export LD_LIBRARY_PATH='$dest/nvidia/cu13/lib'"\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
EOF
echo "$dest/env.sh"
