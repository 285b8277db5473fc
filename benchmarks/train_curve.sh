#!/usr/bin/env bash
# Run 88 (#44): `train --minutes M` from scratch, recipes side by side in ONE run (started
# together, one OpenBLAS thread each, so they share whatever load the machine has), then
# tokens/step of each drafter on 40 MT-Bench first turns (every 2nd question), W4 L5, no
# lookup, greedy, 128 tokens, replayed along the target's greedy paths (`eval-drafter
# --simulate`; the paths are decoded once by the real loop and shared by every drafter).
#
#   bash benchmarks/train_curve.sh OUT MINUTES RECIPE...   # old | new | layers | soft | narrow
#   bash benchmarks/train_curve.sh OUT eval NAME...        # after the runs: OUT/eval-NAME.json
#
# old: the recipe before run 102 (last layer, teacher forcing on the target's argmax, extraction
# 40 % of the minutes), spelled out so that `train --minutes`'s measured table cannot change it;
# layers: --context-layers 2,15,27; new: layers plus --own-drafts 0.25; soft (run 102): the
# target's distribution over the draft vocabulary as the loss's target, plus the hidden-state
# regression, width 2H; narrow (run 103): soft at width H (576 on the embedded model). Each run
# holds out 4,000 tokens (--heldout-tokens; the default 24,000 would eat a 15-minute budget's
# whole extraction share on a loaded machine).
set -uo pipefail
out=${1:?usage: train_curve.sh OUT MINUTES|eval NAME...}; what=${2:?}; shift 2
mkdir -p "$out"
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
export OPENBLAS_NUM_THREADS=1 REDRAFTER_CACHE=$out   # the runs' drafters stay out of yours
py=${PYTHON:-.venv/bin/python}
if [ "$what" = eval ]; then
  for name in "$@"; do
    $py -m redrafter_mlx eval-drafter --drafter "$out/$name" --num-prompts 40 --every 2 \
      --beam-width 4 --beam-length 5 --lookup 0 --max-tokens 128 --simulate \
      --paths-cache "$out/mtb40-paths.json" --json > "$out/eval-$name.json"
  done
  exit
fi
old="--own-drafts 0 --soft-weight 0 --hidden-weight 0 --extract-share 0.4 --exit-dim 0"
declare -A flags=([old]="$old" [layers]="$old --context-layers 2,15,27"
                  [new]="$old --context-layers 2,15,27 --own-drafts 0.25"
                  [soft]="--own-drafts 0 --soft-weight 1 --hidden-weight 1 --extract-share 0.4 --exit-dim 0"
                  [narrow]="--own-drafts 0 --soft-weight 1 --hidden-weight 1 --extract-share 0.4 --exit-dim 576")
for recipe in "$@"; do
  name=$recipe-m$what
  # shellcheck disable=SC2086  # the recipe's flags are words
  $py -m redrafter_mlx train --minutes "$what" --heldout-tokens 4000 --out "$out/$name" \
    --cache-dir "$out/cache-$name" ${flags[$recipe]} > "$out/$name.log" 2>&1 &
done
wait
