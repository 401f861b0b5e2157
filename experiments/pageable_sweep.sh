#!/bin/bash
# Pageable prefetch under staging-slot configurations (plain vs streaming stores, ring size).
P=.gpu/bin/pinstream
lscpu | grep -i 'model name\|L3\|NUMA node\|^CPU(s)'
run() {
  echo "=== $*"
  env "$@" $P prefetch --batch 256 --shape 3x224x224 --compute-ms 0.5 --batches 300 --modes pinstream --source pageable --threads 4 2>&1 | grep -v '^\s*$' | tail -3
}
for rep in 1 2; do
run X=default
run PINSTREAM_STAGING_STREAMING_MAX=0
run PINSTREAM_STAGING_STREAMING_MAX=0 PINSTREAM_STAGING_SLOT_BYTES=512K PINSTREAM_STAGING_SLOTS=24
run PINSTREAM_STAGING_STREAMING_MAX=0 PINSTREAM_STAGING_SLOT_BYTES=1M PINSTREAM_STAGING_SLOTS=16
run PINSTREAM_STAGING_SLOT_BYTES=512K PINSTREAM_STAGING_SLOTS=24
run PINSTREAM_STAGING_STREAMING_MAX=0 PINSTREAM_STAGING_SLOT_BYTES=256K PINSTREAM_STAGING_SLOTS=32
done
