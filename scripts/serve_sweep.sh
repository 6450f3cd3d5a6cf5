#!/usr/bin/env bash
# The serving sweep (docs/serving.md, docs/experiments): output tokens/s at concurrency 1..32 for vanilla
# and each METHOD, through `dcoco serve` + the load generator (HTTP, streaming chat) with a fixed
# draft block and with load-aware drafting, and through the offline engine; then one table and one
# plot of all of them (OUT/sweep.md, OUT/sweep.png).
#
#   scripts/serve_sweep.sh OUT [METHOD[@DRAFTER_DIR] ...]   (default: dflash dcoco, the shipped drafters)
#
# Env: N requests per level (16), TOKENS max_tokens (48), CONC levels (1,4,8,16,32), THREADS torch
# threads of the server and the offline engine (1), PORT (8123), DATASET (mtbench), SPEC_FLAGS
# drafting flags for every drafted run (e.g. "--lookup-first 2").
set -euo pipefail
OUT=${1:?usage: scripts/serve_sweep.sh OUT [METHOD ...]}
shift
METHODS=("$@")
[ ${#METHODS[@]} -gt 0 ] || METHODS=(dflash dcoco)
N=${N:-16}
TOKENS=${TOKENS:-48}
CONC=${CONC:-1,4,8,16,32}
THREADS=${THREADS:-1}
PORT=${PORT:-8123}
DATASET=${DATASET:-mtbench}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$OUT"
load=(--concurrency "$CONC" --num-requests "$N" --max-tokens "$TOKENS" --dataset "$DATASET")

http_sweep() {  # name method [serve flags...]
  local name=$1 method=$2
  shift 2
  echo "== $name: dcoco serve --method $method $*"
  $PYTHON -m dcoco.cli serve --method "$method" --port "$PORT" --threads "$THREADS" --max-batch-size 32 "$@" \
    >"$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 180); do
    $PYTHON -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server $name died: see $OUT/$name.server.log"; exit 1; }
    sleep 1
  done
  $PYTHON -m dcoco.serve.loadgen --url "http://127.0.0.1:$PORT" "${load[@]}" --label "$name" --out "$OUT/$name"
  kill -INT $pid
  wait $pid || true
}

http_sweep vanilla vanilla
runs=("$OUT/vanilla")
variants=vanilla,fixed,load-aware  # offline vanilla once, with the first method
read -r -a spec <<<"${SPEC_FLAGS:-}"
for arg in "${METHODS[@]}"; do
  m=${arg%%@*}
  flags=("${spec[@]}")
  [ "$arg" = "$m" ] || flags+=(--drafter "${arg#*@}")
  http_sweep "$m" "$m" "${flags[@]}"
  http_sweep "$m-load-aware" "$m" --load-aware "${flags[@]}"
  echo "== $m offline: $variants"
  $PYTHON -m dcoco.serve.loadgen --offline --method "$m" --offline-variants "$variants" "${load[@]}" \
    --threads "$THREADS" --label "$m" --out "$OUT/$m-offline" "${flags[@]}"
  runs+=("$OUT/$m" "$OUT/$m-load-aware" "$OUT/$m-offline")
  variants=fixed,load-aware
done
$PYTHON -m dcoco.serve.loadgen --compare "$(IFS=,; echo "${runs[*]}")" --out "$OUT"
