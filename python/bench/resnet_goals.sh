#!/usr/bin/env bash
# Issue 32's ResNet goals in one call on the GPU machine, from the repository root, with the
# packed wheel importable (PYTHONPATH): ResNet-18 and ResNet-50 (AMP, channels_last, batch 256)
# from DataLoader sources (vs_torch.py --only models) and from image_feed (train_feed.py), each
# as a ratio to the ideal over the mean of the ideals beside it, the median over the rounds with
# its 90 % interval, and the ideal itself as a source (`ideal_again`, the method's control).
#   python/bench/resnet_goals.sh [MODEL...]        (default: resnet18)
# Env: ROUNDS (DataLoader rounds, default 12), STEPS (timed steps per round, default 40),
# WARM (untimed steps before them, default 6; 30 leaves a DataLoader's start, its first batches
# and the ring's page-locking, out of the timed steps: the steady state of an epoch),
# FEED_ROUNDS (image_feed runs between ideals, default 6), SOURCES (default: ideal_again,
# ideal_dl4s_discard (a DataLoader of single images, batch_size=256, beside the ideal, its
# batches dropped), dl4s_worker_ring (pinstream's default for it), apex_dl4s_pin,
# dl4_views_worker_ring (a DataLoader of whole batches, batch_size=None), generator), SET (default /tmp/set:
# 5 000 JPEGs made by imagenet_feed.py make from PINSTREAM_SHARED_IMAGES, by default the
# packed copy .gpu/shared/data/images). Exits non-zero if a benchmark fails.
# One model per device call: about 4 minutes for ResNet-18 with the defaults, 7 for ResNet-50
# (the run limit is 10).
# Read a goal as met where the median is at most 1.05; the interval says how sure that is, and
# `ideal_again` how far the machine itself spreads (BENCHMARKS.md, 2026-11-27 ninth session).
set -uo pipefail
here=$(dirname "$0")
rounds=${ROUNDS:-12}
steps=${STEPS:-40}
warm=${WARM:-6}
feed_rounds=${FEED_ROUNDS:-6}
sources=${SOURCES:-ideal_again,ideal_dl4s_discard,dl4s_worker_ring,apex_dl4s_pin,dl4_views_worker_ring,generator}
set_dir=${SET:-/tmp/set}
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(resnet18)
export PINSTREAM_SHARED_IMAGES=${PINSTREAM_SHARED_IMAGES:-$PWD/.gpu/shared/data/images}
if [ ! -d "$set_dir" ]; then
  # Made beside and renamed when complete: a set cut short is never taken for a whole one.
  rm -rf "$set_dir.part"
  python3 "$here/imagenet_feed.py" make "$set_dir.part" --images 5000 >/dev/null || exit 1
  mv "$set_dir.part" "$set_dir"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc
rc=0
only=ideal
for _ in $(seq "$feed_rounds"); do only="$only,pinstream,ideal"; done
for m in "${models[@]}"; do
  echo "== $m from DataLoader sources, $rounds rounds of $steps steps"
  python3 "$here/vs_torch.py" --only models --models "$m" --model-sources "$sources" \
    --model-rounds "$rounds" --model-steps "$steps" --model-warmup "$warm" 2>&1 | grep -E "^    |rror|unknown" || rc=1
  echo "== $m from image_feed, $feed_rounds runs between ideals"
  python3 "$here/train_feed.py" --root "$set_dir" --model "$m" --steps "$((steps + 20))" \
    --only "$only" 2>&1 | grep -E "^ADJACENT|rror|unknown" || rc=1
done
exit $rc
