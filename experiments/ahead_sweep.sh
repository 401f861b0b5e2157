#!/bin/bash
# How far loaders run ahead (PrefetchConfig::ahead): batches written long before the upload
# leave the CPU's cache. Interleaved repetitions; prints ms/batch, ideal and the window.
P=${P:-target/quick/pinstream}
run() {
  printf "%-60s " "$*"
  $P prefetch --batch 256 --shape 3x224x224 --modes pinstream "$@" 2>&1 | tail -1 | awk '{printf "%s %s %s  ", $4, $6, $7; for(i=13;i<=NF;i++) if ($i=="ahead") printf "ahead %s %s %s", $(i+1), $(i+2), $(i+3); print ""}'
}
for rep in 1 2 3 4 5 6; do
for a in 0 3 6; do run --batches 400 --compute-ms 0.5 --source pageable --threads 4 --ahead $a; done
for a in 0 14; do run --batches 400 --compute-ms 0.5 --source pinned --threads 12 --ahead $a; done
done
