#!/usr/bin/env bash
# What the commits since BASE add to the repository's history: packed as a clone fetches them, and
# the text of their diffs (binary files as git's base85 patches). Stage checkpoints dominate both:
# each stage replaces tens of MB of weights, and every replaced version stays in the history, so
# commit a stage's drafters once, when it ends.
#   scripts/history_growth.sh BASE      # e.g. the commit a stage started from
set -euo pipefail
base=${1:?usage: scripts/history_growth.sh BASE}
git rev-parse --verify -q "$base^{commit}" >/dev/null || { echo "history_growth.sh: no commit $base" >&2; exit 2; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
commits=$(git rev-list --count "$base..HEAD")
packed=$(printf '%s\n' "$base..HEAD" | git pack-objects --revs --stdout -q | wc -c)
diffs=$(git log -p --binary --format= "$base..HEAD" | wc -c)
echo "$commits commits since $(git rev-parse --short "$base"): packed $(mib "$packed"), diffs $(mib "$diffs")"
