#!/usr/bin/env bash
# The three-arm RL experiment (docs/rl.md): GRPO on the arithmetic task with no draft, a frozen draft
# and a co-trained draft, for each draft METHOD, one run after another (each alone, so the rollout
# tokens/s compare), then one comparison table and plot per method (OUT/compare-METHOD/).
#
#   scripts/rl_three_arms.sh OUT [METHOD ...]       (default METHODs: dcoco dflash; shipped drafters)
#
# Env: STEPS policy steps per arm (100), THREADS torch threads (2), EXTRA more `key=value` overrides.
# Every run resumes from OUT/<arm> when the script is started again, so a killed sweep loses at most
# the steps since each run's last checkpoint.
set -euo pipefail
OUT=${1:?usage: scripts/rl_three_arms.sh OUT [METHOD ...]}
shift
METHODS=("$@")
[ ${#METHODS[@]} -gt 0 ] || METHODS=(dcoco dflash)
STEPS=${STEPS:-100}
THREADS=${THREADS:-2}
DCOCO=${DCOCO:-$([ -x .venv/bin/dcoco ] && echo .venv/bin/dcoco || echo dcoco)}
common=(--config configs/rl_smollm2.yaml "grpo.steps=$STEPS" "grpo.threads=$THREADS" run.val_every=10 run.checkpoint_every=10)
read -r -a extra <<< "${EXTRA:-}"

arm() {  # name overrides...
  local name=$1
  shift
  echo "== $name: dcoco rl ${common[*]} $* ${extra[*]}"
  $DCOCO rl --no-progress "${common[@]}" "$@" "${extra[@]}" "run.out=$OUT/$name"
}

arm none draft.method=none
for m in "${METHODS[@]}"; do
  arm "$m-frozen" "draft.method=$m" draft.cotrain=false
  arm "$m-cotrained" "draft.method=$m" draft.cotrain=true
  $DCOCO rl compare "$OUT/none" "$OUT/$m-frozen" "$OUT/$m-cotrained" --out "$OUT/compare-$m"
done
