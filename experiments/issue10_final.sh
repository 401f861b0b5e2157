#!/bin/bash
# Issue 10's demonstration in one call: the prefetcher (pageable, pinned, resident) beside
# serial and APEX-style loops, then the PyTorch peer.
P=.gpu/bin/pinstream
$P prefetch --compute-ms 0.5,2,4,8,16 --batches 200
$P prefetch --compute-ms 0.5,4 --batches 300 --modes pinstream --source pinned --threads 12
$P prefetch --compute-ms 0.5 --batches 300 --modes pinstream --source resident
$P prefetch --compute-ms 0.5 --batches 300 --modes pinstream --source pageable
python3 benches/peers/torch_prefetch.py --compute-ms 0.5,2,4,8,16 --batches 100 2>&1 | tail -25
