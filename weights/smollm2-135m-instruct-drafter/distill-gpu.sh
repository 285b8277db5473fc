#!/usr/bin/env bash
# Self-distillation at GPU scale for the embedded SmolLM2-135M-Instruct (made v5 of the shipped
# drafter on one NVIDIA H200 with mlx[cuda13]; runs on any MLX backend, only slower).
#
#   distill-gpu.sh PROMPTS WORK OUT [GEN_SECONDS] [TRAIN_MINUTES]
#
# PROMPTS  the ShareGPT file, or a copy with the assistant turns blanked (same conversations, same
#          held-out split, 1/5 of the size):  see PROVENANCE.md
# WORK     scratch: the extraction cache (about 1.2 GB per million tokens) and the training run
# OUT      gets the cache manifest, then, refreshed while training runs, each variant's best
#          drafter so far (config.json, model.safetensors, train_log.jsonl and its log) as a tar
#          cut into parts of 15 MB: OUT/NAME.tar.part-aa, -ab (cat them, then tar x)
#
# 1. The target answers every distinct user turn of the training conversations (not those of
#    held-out ones) greedily, 512 prompts per batch, for GEN_SECONDS (a kill leaves the cache
#    whole: shards close on whole windows).
# 2. Three variants of INIT (default: the drafter in this folder; v5 grew from v3, see
#    PROVENANCE.md) train on all of it at once for TRAIN_MINUTES each
#    (the cosine schedule is fitted to that time), each keeping its best held-out agreement:
#    grown by one residual layer (the new one starts as the identity; v3's 2 -> 3 for v5) at
#    peak lr 5e-4 or 2e-4, or kept at INIT's layers at 2e-4.
set -uo pipefail
prompts=$1 work=$2 out=$3 gen_seconds=${4:-210} train_minutes=${5:-4.5}
# (PYTHON, GEN_BATCH and HELDOUT_TOKENS shrink it for a dry run on a CPU; SKIP = prompts to
# leave out, those INIT's data already answered: see PROVENANCE.md)
python=${PYTHON:-python3} gen_batch=${GEN_BATCH:-512} heldout_tokens=${HELDOUT_TOKENS:-24000}
skip=${SKIP:-0}
init=${INIT:-$(cd "$(dirname "$0")" && pwd)}
layers=$("$python" -c "import json, sys; print(json.load(open(sys.argv[1]))['num_draft_layers'])" \
  "$init/config.json") || exit 1
grown=$((layers + 1))
mkdir -p "$work" "$out"
common=(--source self --self-prompts all --data "$prompts" --cache-dir "$work/cache"
  --max-seq-len 512 --gen-tokens 256 --heldout-tokens "$heldout_tokens" --seed 0 --quiet)

stamp() { echo "[$(date +%T)] $*"; }
stamp "generate for ${gen_seconds}s"
timeout "$gen_seconds" "$python" -m redrafter_mlx train --extract-only "${common[@]}" \
  --gen-batch "$gen_batch" --max-tokens 100000000 --cache-max-gb 40 --skip-prompts "$skip"
rc=$?
[ $rc -eq 0 ] || [ $rc -eq 124 ] || { stamp "generation failed ($rc)"; exit $rc; }
[ -f "$work/cache/manifest.json" ] || { stamp "no shard finished in ${gen_seconds}s"; exit 1; }
cp "$work/cache/manifest.json" "$out/manifest.json"
tokens=$("$python" -c "import sys; from pathlib import Path; from redrafter_mlx.training.cache import Cache; \
print(Cache.existing(Path(sys.argv[1])).tokens('train'))" "$work/cache")
stamp "generated $tokens training tokens"
[ "$tokens" -gt 0 ] || { stamp "no training shard finished in ${gen_seconds}s"; exit 1; }

publish() {  # OUT/NAME.tar.part-aa, -ab, ...: the best drafter so far (a result folder may
  local name  # take at most 16 MiB per file), each part written aside, then renamed
  for name in "${variants[@]}"; do
    [ -f "$work/$name/model.safetensors" ] || continue
    mkdir -p "$work/pub" && rm -f "$work/pub/$name".*
    tar cf "$work/pub/$name.tar" -C "$work" "$name/config.json" "$name/model.safetensors" \
      "$name/train_log.jsonl" "$name.log" 2>/dev/null || continue
    split -b 15000000 -a 2 "$work/pub/$name.tar" "$work/pub/$name.tar.part-"
    for part in "$work/pub/$name".tar.part-*; do
      cp "$part" "$out/.tmp" && mv "$out/.tmp" "$out/$(basename "$part")"
    done
  done
}
variant() {  # NAME, then the options that differ
  local name=$1
  shift
  "$python" -m redrafter_mlx train "${common[@]}" --max-tokens "$tokens" --init "$init" \
    --positions 4 --batch-size 1024 --hidden-weight 1.0 --epochs 3 --eval-every 1000 \
    --patience 6 --max-minutes "$train_minutes" --out "$work/$name" "$@" >"$work/$name.log" 2>&1
  stamp "$name done ($?)"
}
# three trainings share the GPU (each is bound by kernel launches, not by the chip)
stamp "train for ${train_minutes} min"
variants=() pids=()
for v in "grow$grown-lr5e-4 --num-draft-layers $grown --lr 5e-4" \
  "keep$layers-lr2e-4 --num-draft-layers $layers --lr 2e-4" \
  "grow$grown-lr2e-4 --num-draft-layers $grown --lr 2e-4"; do
  variant $v &
  variants+=("${v%% *}") pids+=($!)
  sleep 10  # loading the cache peaks at twice its size in memory: stagger the starts
done
(while sleep 20; do publish; done) &
copier=$!
wait "${pids[@]}"
kill $copier
publish
stamp "done"
