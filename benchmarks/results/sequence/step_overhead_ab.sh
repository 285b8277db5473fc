#!/bin/bash
# interleaved A/B of benchmarks/step_overhead.py: base checkout vs main, generic plan
for i in 1 2 3 4 5 6; do
  for tree in /work/wt-base /work/main; do
    (cd $tree && REDRAFTER_CPU_TUNING=0 PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python /tmp/step_overhead.py --rounds 5 --reps 6 2>/dev/null | sed "s|^|$tree |")
  done
done
