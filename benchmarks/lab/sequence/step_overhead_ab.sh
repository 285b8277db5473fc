#!/bin/bash
# Interleaved A/B of benchmarks/step_overhead.py between two checkouts (generic plan):
#   benchmarks/lab/sequence/step_overhead_ab.sh BEFORE_DIR AFTER_DIR > out.txt
# Each line: the checkout, then the script's JSON (one-token and ReDrafter W2 L4 step, ms).
script="$(cd "$(dirname "$0")/../.." && pwd)/step_overhead.py"
for i in $(seq 1 ${PAIRS:-10}); do
  for tree in "$1" "$2"; do
    (cd "$tree" && REDRAFTER_CPU_TUNING=0 PYTHONPATH="$tree" timeout 600 .venv/bin/python \
      "$script" --rounds 9 --reps 8 2>/dev/null | sed "s|^|$tree |")
  done
done
