#!/usr/bin/env bash
# A/B of bench/one_batch.py between this tree and another commit's libs/, in one device
# call (trees alternating: the device drifts over consecutive runs).
#
# Here:   bash tools/ab_offline.sh --prepare <commit> [name]  # its libs/ into .carry/<name>
#         (a tree named X runs .carry/X/libs, new runs libs/; carry each)
# Device: carry [".carry/whl", ".carry/base"], then
#         source tools/device_carry.sh --env || exit 1
#         bash tools/ab_one_batch.sh "new base base new" --backends triton \
#           --batch-sizes 1 8 64 --cuda-graph on --engine-args '{"tp_size": 2}'
# Each run prints one_batch's table rows (decode step ms, x roofline), tagged by tree;
# RUN_TIMEOUT_S (default 300) bounds each run.
set -euo pipefail

trees=${1:?usage: bash tools/ab_one_batch.sh "new base ..." <one_batch.py args>}
shift
i=0
for tree in $trees; do
  i=$((i + 1))
  libs=$PWD/libs
  [ "$tree" = new ] || libs=$PWD/.carry/$tree/libs
  [ -d "$libs" ] || { echo "no tree $tree: bash tools/ab_offline.sh --prepare <commit> $tree" >&2; exit 2; }
  echo "== $i $tree"
  PYTHONPATH=/tmp/site:$libs:$PWD timeout "${RUN_TIMEOUT_S:-300}" python3 bench/one_batch.py \
    --tokenizer "${RADIXSERVE_TEST_TOKENIZER_DIR:?source tools/device_carry.sh --env first}" \
    "$@" 2>&1 | grep -E "TB/s|^(torch|triton|flashinfer|auto) " || echo "run $i ($tree) failed"
done
