#!/usr/bin/env bash
# Regenerate training data and train DFlash, DCOCO, DSpark and EAGLE-3 for the embedded
# SmolLM2-135M-Instruct on one GPU, within time budgets that add up to about ten minutes. It has run
# end to end on a CPU with short budgets (DEVICE=cpu) but not yet on a GPU: the shipped checkpoints
# come from the CPU recipe in src/dcoco/checkpoints/smollm2-135m-instruct/README.md.
#
#   scripts/train_on_gpu.sh SOURCE [DATA_DIR ...]
#
# SOURCE: 'sharegpt' (the training split) or a ShareGPT-format .jsonl of prompts. DATA_DIRs: data
# already regenerated (with or without features) to train on as well.
#
# 1. SHARDS regeneration processes share the GPU for REGEN_S seconds, each answering every
#    SHARDS-th prompt (--shard i/N) and keeping only the tokens (--no-features).
# 2. DFlash, DSpark and EAGLE-3 train side by side with online features (a target forward per
#    batch): DFlash for TRAIN_S seconds, then the DCOCO corrector on the frozen DFlash for DCOCO_S;
#    DSpark and EAGLE-3 for TRAIN_S + DCOCO_S, the same wall time (optim.time_budget_s; the steps it
#    chose are in each log.jsonl and checkpoint's dcoco_training config).
set -uo pipefail

SOURCE=${1:?usage: scripts/train_on_gpu.sh SOURCE [DATA_DIR ...]}
shift
DEVICE=${DEVICE:-cuda}
SHARDS=${SHARDS:-6}
REGEN_S=${REGEN_S:-150}
REGEN_BATCH=${REGEN_BATCH:-128}
TRAIN_S=${TRAIN_S:-200}
DCOCO_S=${DCOCO_S:-50}
BATCH=${BATCH:-32}
DATA=${DATA:-data/gpu}
OUT=${OUT:-runs/gpu}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DCOCO=${DCOCO:-$PYTHON -m dcoco.cli}
LOGS=$OUT/logs
mkdir -p "$DATA" "$LOGS"
stamp() { echo "[$(date +%T)] $*"; }

stamp "preparing the target"
$PYTHON -c "from dcoco.models import default_model_dir; default_model_dir()" || exit 1

stamp "regenerating for ${REGEN_S}s with $SHARDS processes"
for i in $(seq 0 $((SHARDS - 1))); do
  timeout -s INT "$REGEN_S" $DCOCO data regenerate --source "$SOURCE" --shard "$i/$SHARDS" --out "$DATA/regen-$i" \
    --num-samples 1000000 --no-features --device "$DEVICE" --batch-size "$REGEN_BATCH" >"$LOGS/regen-$i.log" 2>&1 &
done
wait
dirs=("$@")
for i in $(seq 0 $((SHARDS - 1))); do
  [ -s "$DATA/regen-$i/samples.jsonl" ] && dirs+=("$DATA/regen-$i")
done
n_new=$(cat "$DATA"/regen-*/samples.jsonl 2>/dev/null | wc -l)
stamp "regenerated $n_new samples; training on ${dirs[*]}"
paths="data.path=[$(IFS=,; echo "${dirs[*]}")]"
common=(target.device="$DEVICE" data.features=online "$paths" optim.batch_size="$BATCH" optim.threads=2
        run.checkpoint_every=250 run.eval_every=250)

train() {  # name config seconds [overrides...]
  local name=$1 config=$2 seconds=$3
  shift 3
  $DCOCO train --config "$config" "${common[@]}" optim.time_budget_s="$seconds" run.out="$OUT/$name" "$@" \
    >"$LOGS/train-$name.log" 2>&1
  stamp "$name finished (exit $?)"
}
side=$((TRAIN_S + DCOCO_S + 20))  # DCOCO's own start-up included
train dspark configs/dspark_smollm2.yaml "$side" drafter.markov_rank=32 &
train eagle3 configs/eagle3_smollm2.yaml "$side" &
train dflash configs/dflash_smollm2.yaml "$TRAIN_S"
train dcoco configs/dcoco_smollm2.yaml "$DCOCO_S" drafter.init_from="$OUT/dflash/drafter"
wait
stamp "done: $OUT"
