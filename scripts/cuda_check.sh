#!/usr/bin/env bash
# Device check: run dcoco end to end on a GPU (or any torch device) and say what broke.
#
#   scripts/cuda_check.sh                          # on a machine with CUDA
#   DEVICE=cpu QUICK=1 scripts/cuda_check.sh       # the same steps on CPU, tiny sizes (checks the script)
#
# Steps (each logged to $OUT/<step>.log; a failing step does not stop the others):
#   env       torch / CUDA versions; fails at once if DEVICE is cuda* and torch.cuda.is_available() is False
#   generate  every shipped method (vanilla ngram dflash dcoco dspark eagle3) on a batch of two prompts of
#             different lengths, float32: greedy output must equal vanilla's token for token, and a seeded
#             T=1 (top-p 0.9) run must complete
#   bench     a short `dcoco bench` (float32 by default, T=0 and T=1; QUICK: T=0): every T=0 row's greedy_match_rate
#             against vanilla must be 1.0
#   train     `dcoco data regenerate` on the device, then a few `dcoco train` steps per family on it, then
#             the freshly trained drafter generates on the device and must equal vanilla's greedy output
#
# float32 greedy equality is exact in principle (verification is lossless); on a GPU, kernels chosen per
# block length can in rare near-ties flip an argmax. A mismatch fails the run and names the first
# differing position; EXACT=0 reports mismatches without failing.
#
# Knobs (environment): DEVICE (cuda), OUT (cuda-check), QUICK (0; 1 = tiny sizes for a CPU proof run),
# METHODS, TRAIN_METHODS, NEW_TOKENS, BENCH_NEW_TOKENS, BENCH_PROMPTS, BENCH_DTYPE, BENCH_TEMPS, DATA_SAMPLES,
# TRAIN_STEPS, EXACT (1), DCOCO (.venv/bin/dcoco), PY (.venv/bin/python).
set -uo pipefail
OUT=$(realpath -m "${OUT:-cuda-check}")  # relative to the caller's directory
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
EXACT=${EXACT:-1}
DCOCO=${DCOCO:-.venv/bin/dcoco}
PY=${PY:-.venv/bin/python}
METHODS=${METHODS:-vanilla ngram dflash dcoco dspark eagle3}
TRAIN_METHODS=${TRAIN_METHODS:-dflash dcoco dspark eagle3}
BENCH_DTYPE=${BENCH_DTYPE:-float32}
if [ "$QUICK" = 1 ]; then
    NEW_TOKENS=${NEW_TOKENS:-12}
    BENCH_NEW_TOKENS=${BENCH_NEW_TOKENS:-8}
    BENCH_PROMPTS=${BENCH_PROMPTS:-1}
    DATA_SAMPLES=${DATA_SAMPLES:-2}
    TRAIN_STEPS=${TRAIN_STEPS:-2}
    BENCH_TEMPS=${BENCH_TEMPS:-0}
    DATA_MAX_NEW=(--max-new-tokens 24)
    TRAIN_SMALL=(optim.batch_size=2 optim.anchors_per_seq=4 data.max_length=128)
else
    NEW_TOKENS=${NEW_TOKENS:-48}
    BENCH_NEW_TOKENS=${BENCH_NEW_TOKENS:-32}
    BENCH_PROMPTS=${BENCH_PROMPTS:-2}
    DATA_SAMPLES=${DATA_SAMPLES:-8}
    TRAIN_STEPS=${TRAIN_STEPS:-5}
    BENCH_TEMPS=${BENCH_TEMPS:-0,1}
    DATA_MAX_NEW=()
    TRAIN_SMALL=()
fi
PROMPTS=(--prompt "Repeat this list exactly, then sort it: pear, apple, fig, plum, kiwi."
         --prompt "What is the capital of France?")

mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$(date +%s)

# step NAME CMD...: run CMD with stdout+stderr in $OUT/NAME.log, record PASS/FAIL and its duration
step() {
    local name=$1; shift
    local t0=$(date +%s)
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local line
    if [ $rc -eq 0 ]; then line="PASS  $name ($(( $(date +%s) - t0 ))s)"
    else line="FAIL  $name (exit $rc, $(( $(date +%s) - t0 ))s): see $OUT/$name.log"; FAILED=1; fi
    echo "$line" | tee -a "$SUMMARY"
    return $rc
}

# same_as_vanilla FILE: FILE's greedy token ids (generate --json, one object per prompt) equal vanilla's
same_as_vanilla() {
    "$PY" - "$OUT/generate-vanilla-t0.jsonl" "$1" "$EXACT" <<'EOF'
import json, sys
ref, got = ([json.loads(l)["token_ids"] for l in open(p) if l.startswith("{")] for p in sys.argv[1:3])
bad = []
for i, (a, b) in enumerate(zip(ref, got)):
    if a != b:
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        bad.append(f"prompt {i}: first difference at token {pos} (vanilla {a[pos:pos + 3]}, got {b[pos:pos + 3]})")
if len(ref) != len(got) or not ref:
    bad.append(f"{len(got)} outputs, vanilla has {len(ref)}")
print("\n".join(bad) if bad else f"{len(got)} outputs equal vanilla's ({[len(a) for a in got]} tokens)")
sys.exit(1 if bad and sys.argv[3] == "1" else 0)
EOF
}

# generate METHOD TAG [ARGS...]: `dcoco generate --json` on the device, float32
generate() {
    local method=$1 tag=$2; shift 2
    "$DCOCO" generate "${PROMPTS[@]}" --method "$method" --device "$DEVICE" --dtype float32 \
        --max-new-tokens "$NEW_TOKENS" --json "$@" > "$OUT/generate-$method-$tag.jsonl"
}

echo "dcoco device check: DEVICE=$DEVICE OUT=$OUT QUICK=$QUICK" | tee -a "$SUMMARY"

# -- env ---------------------------------------------------------------------------------------
env_check() {
    command -v nvidia-smi > /dev/null && nvidia-smi
    "$PY" - "$DEVICE" <<'EOF'
import sys, torch
dev = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if dev.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit(f"DEVICE={dev} but torch.cuda.is_available() is False")
    d = torch.device(dev)
    print("device", torch.cuda.get_device_name(d), "tf32 matmul", torch.backends.cuda.matmul.allow_tf32)
x = torch.ones(2, 2, device=dev)
print("a tensor on", (x @ x).device)
EOF
}
step env env_check || { echo "no usable $DEVICE: stopping" | tee -a "$SUMMARY"; exit 1; }

# -- generate ------------------------------------------------------------------------------------
for m in $METHODS; do
    step "generate-$m-t0" generate "$m" t0
    if [ "$m" != vanilla ] && [ -s "$OUT/generate-vanilla-t0.jsonl" ] && [ -s "$OUT/generate-$m-t0.jsonl" ]; then
        step "generate-$m-t0-equals-vanilla" same_as_vanilla "$OUT/generate-$m-t0.jsonl"
    fi
    step "generate-$m-t1" generate "$m" t1 --temperature 1 --top-p 0.9 --seed 7
done

# -- bench ---------------------------------------------------------------------------------------
bench_methods=$(echo "$METHODS" | tr ' ' ',')
step bench "$DCOCO" bench --methods "$bench_methods" --datasets mtbench_turn1 --num-prompts "$BENCH_PROMPTS" \
    --max-new-tokens "$BENCH_NEW_TOKENS" --temperatures "$BENCH_TEMPS" --seeds 42 --dtype "$BENCH_DTYPE" \
    --device "$DEVICE" --out "$OUT/bench" --no-progress
bench_match() {
    "$PY" - "$OUT/bench/results.json" "$EXACT" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
t0 = [r for r in rows if r.get("temperature") == 0 and r.get("greedy_match_rate") is not None]
bad = [r for r in t0 if r["greedy_match_rate"] != 1.0]
for r in rows:
    print(r.get("method"), "T", r.get("temperature"), "tok/s", r.get("tokens_per_second"),
          "accept", r.get("acceptance_length"), "greedy_match", r.get("greedy_match_rate"))
if not t0:
    sys.exit("no T=0 row with a greedy_match_rate")
if bad:
    print("greedy mismatch:", [r["method"] for r in bad])
sys.exit(1 if bad and sys.argv[2] == "1" else 0)
EOF
}
[ -s "$OUT/bench/results.json" ] && step bench-greedy-match bench_match

# -- train ---------------------------------------------------------------------------------------
rm -rf "$OUT/data"
if step data-regenerate "$DCOCO" data regenerate --out "$OUT/data" --num-samples "$DATA_SAMPLES" \
        --device "$DEVICE" "${DATA_MAX_NEW[@]}"; then
    for m in $TRAIN_METHODS; do
        rm -rf "$OUT/train-$m"
        extra=()
        if [ "$m" = dcoco ]; then  # its config warm-starts from a trained DFlash drafter: this run's, else the shipped one
            init="$OUT/train-dflash/drafter"
            [ -s "$init/config.json" ] || init=src/dcoco/checkpoints/smollm2-135m-instruct/dflash
            extra=(drafter.init_from="$init")
        fi
        step "train-$m" "$DCOCO" train --config "configs/${m}_smollm2.yaml" target.device="$DEVICE" \
            data.path="$OUT/data" optim.steps="$TRAIN_STEPS" run.out="$OUT/train-$m" run.eval_every="$TRAIN_STEPS" \
            run.checkpoint_every="$TRAIN_STEPS" "${TRAIN_SMALL[@]}" "${extra[@]}" || continue
        if step "train-$m-generate" generate "$m" trained --drafter "$OUT/train-$m/drafter" \
                && [ -s "$OUT/generate-vanilla-t0.jsonl" ]; then
            step "train-$m-generate-equals-vanilla" same_as_vanilla "$OUT/generate-$m-trained.jsonl"
        fi
    done
fi

echo "total $(( $(date +%s) - START ))s; $( [ $FAILED = 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')" \
    | tee -a "$SUMMARY"
exit $FAILED
