#!/usr/bin/env bash
# A/B of the cached shared-prefix run (bench/offline.py --workloads shared-prefix
# --radix on) between this tree and another commit's libs/, in one device call.
#
# The first offline run on a lent GPU is its fastest, whatever tree it runs, and the
# device slows over consecutive runs: compare trees in an alternating order, e.g.
# new base base new (docs/performance.md).
#
# Here:   bash tools/ab_offline.sh --prepare <commit> [name]  # its libs/ into .carry/<name>
#         (name: base by default; a tree named X below runs .carry/X/libs, new runs libs/)
# Device: carry [".carry/whl", ".carry/base"], then
#         source tools/device_carry.sh --env || exit 1; bash tools/ab_offline.sh new base base new
# Each run writes $OUT/run<i>-<tree>.json and prints its total time, mixed-step and
# decode-step seconds.
set -euo pipefail

if [ "${1:-}" = "--prepare" ]; then
  commit=${2:?usage: bash tools/ab_offline.sh --prepare <commit> [name]}
  name=${3:-base}
  case $name in new | */* | .*) echo "a tree name is a plain word, not new: $name" >&2; exit 2 ;; esac
  rm -rf ".carry/$name" && mkdir -p ".carry/$name"
  git archive "$commit" libs | tar -x -C ".carry/$name"
  echo "libs/ of $(git rev-parse --short "$commit") in .carry/$name"
  exit 0
fi

out=${OUT:?OUT must name the folder for the results (the device sets it)}
i=0
for tree in "$@"; do
  i=$((i + 1))
  libs=$PWD/libs
  [ "$tree" = new ] || libs=$PWD/.carry/$tree/libs
  [ -d "$libs" ] || { echo "no tree $tree: bash tools/ab_offline.sh --prepare <commit> $tree" >&2; exit 2; }
  json="$out/run$i-$tree.json"
  PYTHONPATH=/tmp/site:$libs:$PWD python3 bench/offline.py \
    --workloads shared-prefix --radix on --json "$json" >/dev/null
  python3 - "$json" "$i" "$tree" <<'PY'
import json, sys
row = json.load(open(sys.argv[1]))["rows"][0]
print(
    f"{sys.argv[2]} {sys.argv[3]:4s} {row['total_throughput'] / 1e3:6.1f}k tok/s "
    f"{row['duration_s']:6.2f} s  mixed steps {row['prefill_steps_s']:5.2f} s  "
    f"decode steps {row['decode_steps_s']:5.2f} s"
)
PY
done
