#!/usr/bin/env bash
# What fault tolerance and the flight recorder cost per step: the GPT trainer's default shape
# over TCP processes (burnrun), three ways, alternating whole runs so that the machine's drift
# hits all alike:
#   base      no flight recorder (BURN_PARALLEL_FLIGHT_ENTRIES=0), plain data parallelism
#   recorder  the flight recorder on (its default), plain data parallelism
#   ft        the flight recorder on, --fault-tolerant (the per-step exchange and quorum in
#             place of the data-parallel all-reduce)
#
#   bash scripts/ft_overhead.sh [ROUNDS] [NPROC] [STEPS]     (defaults: 5 rounds, 2 ranks, 60)
#
# Each run prints the mean seconds per step of its steps after the first (the trainer's
# "s/step"); the script prints every run, the mean of each way, and the ratios recorder/base
# and ft/base, ft/recorder (the quorum alone). Binaries: $GPT (default target/release/gpt) and
# $BURNRUN (default target/release/burnrun); build them with
#   cargo build --release -p examples --bin gpt -p burn-parallel --bin burnrun
set -euo pipefail

ROUNDS=${1:-5}
NPROC=${2:-2}
STEPS=${3:-60}
cd "$(dirname "${BASH_SOURCE[0]}")/.."   # the repository root: examples/data is found from here
GPT=${GPT:-target/release/gpt}
BURNRUN=${BURNRUN:-target/release/burnrun}
for b in "$GPT" "$BURNRUN"; do
  [ -x "$b" ] || { echo "no executable at $b (see the header for the build command)" >&2; exit 1; }
done

# Seconds per step of one run: the trainer's summary line says "..., 0.123 s/step, ...".
run() {
  local entries=$1; shift
  BURN_PARALLEL_FLIGHT_ENTRIES=$entries "$BURNRUN" --nproc-per-node "$NPROC" -- \
    "$GPT" --backend tcp --steps "$STEPS" "$@" 2>/dev/null \
    | sed -n 's/.* \([0-9.]*\) s\/step.*/\1/p' | tail -1
}

declare -a base recorder ft
for ((i = 1; i <= ROUNDS; i++)); do
  b=$(run 0); r=$(run 2048); f=$(run 2048 --fault-tolerant)
  [ -n "$b" ] && [ -n "$r" ] && [ -n "$f" ] || { echo "a run printed no s/step" >&2; exit 1; }
  base+=("$b"); recorder+=("$r"); ft+=("$f")
  printf 'round %d: base %s s/step, recorder %s, ft %s\n' "$i" "$b" "$r" "$f"
done

mean() { printf '%s\n' "$@" | awk '{s += $1} END {printf "%.5f", s / NR}'; }
mb=$(mean "${base[@]}"); mr=$(mean "${recorder[@]}"); mf=$(mean "${ft[@]}")
printf 'mean s/step over %d rounds (%d ranks, %d steps): base %s, recorder %s, ft %s\n' \
  "$ROUNDS" "$NPROC" "$STEPS" "$mb" "$mr" "$mf"
awk -v b="$mb" -v r="$mr" -v f="$mf" 'BEGIN {
  printf "recorder / base = %.4f (%+.2f%%)\n", r / b, 100 * (r / b - 1)
  printf "ft / base       = %.4f (%+.2f%%)\n", f / b, 100 * (f / b - 1)
  printf "ft / recorder   = %.4f (%+.2f%%): the quorum and exchange alone\n", f / r, 100 * (f / r - 1)
}'
