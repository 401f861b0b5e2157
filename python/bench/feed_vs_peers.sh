#!/usr/bin/env bash
# The image feed against its peers in one run on one GPU (BENCHMARKS.md, issue 31), on the GPU
# machine, from the repository root, with:
#   IMAGENET_FEED   the release `imagenet_feed` example (built here, stripped, carried), default
#                   ./.imagenet_feed
#   DALI, if present in /tmp/dalisite (../shared/gpu/dali's parts, reassembled), else skipped.
#   python/bench/feed_vs_peers.sh [THREADS...]            (default: 8 4 2)
# Env: EPOCHS (default 10; reported: the "steady" figures over every epoch but the first, and
# the last epoch), SET (default /tmp/set: 5 000 JPEGs made by imagenet_feed.py make), AT_ONCE
# (pinstream's --decodes-at-once: default 0, automatic; `none` for no cap).
set -u
feed=${IMAGENET_FEED:-./.imagenet_feed}
epochs=${EPOCHS:-10}
set_dir=${SET:-/tmp/set}
here=$(dirname "$0")
[ -d "$set_dir" ] || python3 "$here/imagenet_feed.py" make "$set_dir" --images 5000 >/dev/null
if [ -d /tmp/dalisite ]; then
  export PYTHONPATH=/tmp/dalisite${PYTHONPATH:+:$PYTHONPATH}
  export LD_LIBRARY_PATH=/tmp/dalisite/nvidia/cu13/lib:/tmp/dalisite/nvidia/nvjpeg2k/lib:/tmp/dalisite/nvidia/nvtiff/lib:/tmp/dalisite/nvidia/libnvcomp/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
threads=("$@")
[ ${#threads[@]} -gt 0 ] || threads=(8 4 2)
for t in "${threads[@]}"; do
  timeout 300 "$feed" "$set_dir" --threads "$t" --epochs "$epochs" --json --decode gpu \
    --decodes-at-once "${AT_ONCE:-0}" 2>&1 | grep -E "FEED_JSON|FEED_STEADY|rror" | tail -2
  if [ -d /tmp/dalisite ]; then
    timeout 300 python3 "$here/decode_peers.py" dali --root "$set_dir" --threads "$t" --epochs "$epochs" 2>&1 | tail -1
  fi
  timeout 300 python3 "$here/decode_peers.py" tv_gpu --root "$set_dir" --threads "$t" --epochs "$epochs" 2>&1 | tail -1
done
