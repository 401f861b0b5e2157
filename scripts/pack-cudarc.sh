#!/usr/bin/env bash
# Adds the cudarc feature's executables to a .gpu/ folder made by ../shared/gpu/pack (which
# builds the workspace's features: the defaults and safetensors): the interop test executable
# built with `--features cudarc` (its cudarc trials included) replaces the packed one in
# .gpu/test/ (so `.gpu/run` runs it with the others), and the to_cudarc example goes into
# .gpu/bin/; then .gpu.tar.xz is re-created.
#
#   ../shared/gpu/pack && scripts/pack-cudarc.sh
#   # on the device: tar xJf .gpu.tar.xz && .gpu/run            (or .gpu/test/interop-* alone)
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
[ -d .gpu/test ] || { echo "pack-cudarc: run ../shared/gpu/pack first" >&2; exit 1; }
json=$(mktemp)
trap 'rm -f "$json"' EXIT
cargo test --release -p pinstream --features cudarc,safetensors --test interop --no-run --message-format=json > "$json"
cargo build --release -p pinstream --features cudarc --example to_cudarc --message-format=json >> "$json"
rm -f .gpu/test/interop-*
python3 - "$json" <<'PY'
import json, os, shutil, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name, kinds = m["target"]["name"], m["target"]["kind"]
    if name == "interop" and m["profile"]["test"]:
        dest = os.path.join(".gpu/test", os.path.basename(m["executable"]))
    elif name == "to_cudarc" and "example" in kinds:
        dest = ".gpu/bin/to_cudarc"
    else:
        continue
    shutil.copy2(m["executable"], dest)
    print(f"packed {dest}")
PY
strip .gpu/test/interop-* .gpu/bin/to_cudarc 2>/dev/null || true
XZ_OPT=-T0 tar cJf .gpu.tar.xz .gpu
echo "packed: .gpu ($(du -sh .gpu | cut -f1)), .gpu.tar.xz ($(du -sh .gpu.tar.xz | cut -f1))"
echo "on the device: carry [\".gpu.tar.xz\"], command: tar xJf .gpu.tar.xz && .gpu/test/interop-* cudarc/ && .gpu/bin/to_cudarc"
