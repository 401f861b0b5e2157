#!/usr/bin/env bash
# The bandwidth goals, measured fairly on a GPU machine: pinstream and PyTorch alternate
# three times in one call (the link's rate drifts by several GB/s over minutes, so one run of
# each is not a comparison). Usage: benchmarks/goals.sh PINSTREAM_EXE OUTDIR
set -euo pipefail
exe=${1:-.gpu/bin/pinstream}
out=${2:-.}
for round in 1 2 3; do
  echo "== round $round: pinstream"
  "$exe" bandwidth --sizes 16M,256M --kinds pinned --directions h2d,d2h,bidir --samples 9 --pin-size 64M \
    | tee "$out/pinstream-$round.txt" | grep -E "pinned" || true
  echo "== round $round: pinstream --chunk 16M"
  "$exe" bandwidth --sizes 256M --kinds pinned --directions h2d,bidir --samples 9 --pin-size 64M --chunk 16M \
    | tee "$out/pinstream-chunk-$round.txt" | grep -E "pinned" || true
  echo "== round $round: torch"
  python3 benches/peers/torch_bandwidth.py | tee "$out/torch-$round.txt"
done
