#!/usr/bin/env bash
# Run 102's sweep (#44): training alone on run 98's extraction cache (copied per run), scored by
# held-out agreement. bash sweep.sh NAME [train flags...]; env SRC (the cache to copy, default
# run 98's 15-minute one), TOK (its training tokens), MIN (training minutes, default 4). Run 98's
# folder was /work/curve98 (benchmarks/train_curve.sh /work/curve98 ...); its model conversion
# there is reused through REDRAFTER_CACHE so the caches' identity matches.
name=$1; shift
cd /work/main
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 REDRAFTER_CACHE=/work/curve98
rm -rf /work/sw/$name /work/sw/cache-$name
cp -r ${SRC:-/work/curve98/cache-old-m15} /work/sw/cache-$name
.venv/bin/python -m redrafter_mlx train --cache-dir /work/sw/cache-$name --max-tokens ${TOK:-17603} --heldout-tokens 4000 \
  --max-minutes ${MIN:-4} --epochs 100 --eval-prompts 0 --out /work/sw/$name "$@" > /work/sw/$name.log 2>&1
echo done > /work/sw/$name.done
