#!/usr/bin/env bash
# How many steps does Muon need to reach the validation loss AdamW reaches in 600 steps, on the
# bundled King James Bible with the trainer's default model and batch, each optimizer's
# learning rate tuned?
#
#   bash scripts/muon_quality.sh [GPT_BINARY]      (default: target/release/gpt)
#
# Protocol (every run: the trainer's defaults but --optim/--lr/--steps/--seed; --seed is the
# seed of the weights, default 42; the data order does not depend on it):
#   1. AdamW, 600 steps, --lr in {1e-3,2e-3,3e-3,6e-3,1e-2}; best (lowest final validation loss)
#      = L_A at lr_A. A best at an edge extends the grid one step that way (1-2-3-6 per decade),
#      up to MAX_EXTEND times.
#   2. Muon, 600 steps, --lr in {2e-3,3e-3,6e-3,1e-2,2e-2}, the same rule: lr_M.
#   3. Muon at lr_M, --steps in {150,200,250,300,400,500} (each a whole run with its own warm-up
#      and cosine schedule): N = the smallest budget whose validation loss <= L_A (seed 42).
#      None: Muon's loss at 600 against L_A.
#   4. Seeds: AdamW (600, lr_A) and Muon (N, lr_M) again with --seed 1 and 2; the conclusion is
#      re-decided on the 3-seed means (Muon's budgets around N re-run on the same seeds until the
#      smallest budget whose mean <= AdamW's mean is bracketed), like seeds compared too.
# Prints a table (optimizer, lr, steps, seed, train loss, validation loss) and the answer line.
# Each run's whole log goes to $LOG_DIR (default: a fresh folder under /tmp).
set -euo pipefail

BIN=${1:-target/release/gpt}
case "$BIN" in /*) ;; *) BIN="$PWD/$BIN" ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."   # the repository root: examples/data is found from here
[ -x "$BIN" ] || { echo "no executable gpt binary at $BIN" >&2; exit 1; }
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/muon_quality.XXXXXX)}
mkdir -p "$LOG_DIR"
MAX_EXTEND=${MAX_EXTEND:-2}

ADAMW_GRID=(1e-3 2e-3 3e-3 6e-3 1e-2)
MUON_GRID=(2e-3 3e-3 6e-3 1e-2 2e-2)
BUDGETS=(150 200 250 300 400 500 600)   # 600 only as the top of the ladder (the sweep's run)
BASE_STEPS=600
SEED0=42
SEEDS=(42 1 2)

start=$(date +%s)
declare -A VAL TRAIN
ROWS=()

# lt A B: A < B as numbers, a NaN/inf/missing loss being worse than any number.
num() { [[ $1 =~ ^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]] && echo "$1" || echo 1e30; }
lt() { awk -v a="$(num "$1")" -v b="$(num "$2")" 'BEGIN { exit !(a < b) }'; }
le() { awk -v a="$(num "$1")" -v b="$(num "$2")" 'BEGIN { exit !(a <= b) }'; }
mean() { awk 'BEGIN { s = 0; for (i = 1; i < ARGC; i++) { if (ARGV[i] !~ /^-?[0-9.]+([eE][-+]?[0-9]+)?$/) { print "nan"; exit } s += ARGV[i] } printf "%.4f", s / (ARGC - 1) }' "$@"; }
spread() { awk 'BEGIN { lo = 1e30; hi = -1e30; for (i = 1; i < ARGC; i++) { v = ARGV[i] + 0; if (v < lo) lo = v; if (v > hi) hi = v } printf "%.4f", hi - lo }' "$@"; }
# The next value of the 1-2-3-6 ladder, up or down.
LADDER=(1e-4 2e-4 3e-4 6e-4 1e-3 2e-3 3e-3 6e-3 1e-2 2e-2 3e-2 6e-2 1e-1 2e-1)
lr_step() {   # lr_step LR +1|-1
  local i; for i in "${!LADDER[@]}"; do [ "${LADDER[$i]}" = "$1" ] && { echo "${LADDER[$((i + $2))]}"; return; }; done
  echo "lr $1 is not on the ladder" >&2; exit 1
}

# run OPTIM LR STEPS SEED: one training run (cached), its losses in VAL/TRAIN[key].
run() {
  local optim=$1 lr=$2 steps=$3 seed=$4 key="$1 $2 $3 $4"
  [ -n "${VAL[$key]+x}" ] && return 0
  local log="$LOG_DIR/${optim}_lr${lr}_s${steps}_seed${seed}.log" t0=$SECONDS line tr va
  if ! "$BIN" --optim "$optim" --lr "$lr" --steps "$steps" --seed "$seed" --log-every 100 >"$log" 2>&1; then
    echo "  (run failed, exit status in $log)" >&2
  fi
  line=$(grep -E '^final train loss' "$log" | tail -1 || true)
  tr=$(sed -nE 's/^final train loss ([^,]+),.*/\1/p' <<<"$line")
  va=$(sed -nE 's/.*validation loss ([^ ]+) nats.*/\1/p' <<<"$line")
  TRAIN[$key]=${tr:-fail}; VAL[$key]=${va:-fail}
  ROWS+=("$key")
  printf '  %-6s lr %-5s steps %4s seed %3s: train %-8s val %-8s (%ds)\n' \
    "$optim" "$lr" "$steps" "$seed" "${TRAIN[$key]}" "${VAL[$key]}" $((SECONDS - t0)) >&2
}

# sweep OPTIM GRID...: 600-step runs over the grid, extended at an edge; the best lr in BEST.
# (No command substitution around run: its results must land in this shell.)
sweep() {
  local optim=$1; shift
  local grid=("$@") best lr i ext=0
  for lr in "${grid[@]}"; do run "$optim" "$lr" $BASE_STEPS $SEED0; done
  while :; do
    best=${grid[0]}
    for lr in "${grid[@]}"; do lt "${VAL[$optim $lr $BASE_STEPS $SEED0]}" "${VAL[$optim $best $BASE_STEPS $SEED0]}" && best=$lr; done
    [ $ext -ge "$MAX_EXTEND" ] && break
    if [ "$best" = "${grid[0]}" ]; then lr=$(lr_step "$best" -1); grid=("$lr" "${grid[@]}")
    elif [ "$best" = "${grid[${#grid[@]}-1]}" ]; then lr=$(lr_step "$best" 1); grid+=("$lr")
    else break; fi
    echo "  best $optim lr $best at the grid's edge: extending to $lr" >&2
    run "$optim" "$lr" $BASE_STEPS $SEED0
    ext=$((ext + 1))
  done
  BEST=$best
}

echo "== 1. AdamW, $BASE_STEPS steps, lr sweep" >&2
sweep adamw "${ADAMW_GRID[@]}"; LR_A=$BEST
L_A=${VAL[adamw $LR_A $BASE_STEPS $SEED0]}
echo "  L_A = $L_A at lr_A = $LR_A" >&2

echo "== 2. Muon, $BASE_STEPS steps, lr sweep" >&2
sweep muon "${MUON_GRID[@]}"; LR_M=$BEST
echo "  lr_M = $LR_M (val ${VAL[muon $LR_M $BASE_STEPS $SEED0]})" >&2

echo "== 3. Muon at lr_M, step budgets (seed $SEED0)" >&2
N=""
for s in "${BUDGETS[@]}"; do
  run muon "$LR_M" "$s" $SEED0
  if [ -z "$N" ] && le "${VAL[muon $LR_M $s $SEED0]}" "$L_A"; then N=$s; fi
done

echo "== 4. Seeds ${SEEDS[*]}" >&2
for seed in "${SEEDS[@]}"; do run adamw "$LR_A" $BASE_STEPS "$seed"; done
a_vals=(); for seed in "${SEEDS[@]}"; do a_vals+=("${VAL[adamw $LR_A $BASE_STEPS $seed]}"); done
MEAN_A=$(mean "${a_vals[@]}")
# muon_ok I: Muon at BUDGETS[I] on every seed; true when its mean <= AdamW's mean.
muon_ok() {
  local s=${BUDGETS[$1]} v=() seed
  for seed in "${SEEDS[@]}"; do run muon "$LR_M" "$s" "$seed"; v+=("${VAL[muon $LR_M $s $seed]}"); done
  le "$(mean "${v[@]}")" "$MEAN_A"
}
idx_of() { local i; for i in "${!BUDGETS[@]}"; do [ "${BUDGETS[$i]}" = "$1" ] && { echo "$i"; return; }; done; }
# Bracket the smallest budget whose 3-seed mean reaches AdamW's 3-seed mean, starting at N.
N_MEAN=""
i=$(idx_of "${N:-$BASE_STEPS}")
if muon_ok "$i"; then
  N_MEAN=${BUDGETS[$i]}
  while [ "$i" -gt 0 ]; do   # down while the budget below passes too (it is run on every seed)
    if muon_ok $((i - 1)); then i=$((i - 1)); N_MEAN=${BUDGETS[$i]}; else break; fi
  done
else
  while [ $((i + 1)) -lt ${#BUDGETS[@]} ]; do
    i=$((i + 1))
    if muon_ok "$i"; then N_MEAN=${BUDGETS[$i]}; break; fi
  done
fi
elapsed=$(( $(date +%s) - start ))

# The table, in run order.
echo
printf '%-6s  %-6s  %5s  %4s  %10s  %10s\n' optim lr steps seed train_loss val_loss
for key in "${ROWS[@]}"; do
  read -r o l s sd <<<"$key"
  printf '%-6s  %-6s  %5s  %4s  %10s  %10s\n' "$o" "$l" "$s" "$sd" "${TRAIN[$key]}" "${VAL[$key]}"
done

echo
echo "L_A = $L_A nats/byte (AdamW, lr_A = $LR_A, $BASE_STEPS steps, seed $SEED0); lr_M = $LR_M"
echo "AdamW $BASE_STEPS steps over seeds ${SEEDS[*]}: ${a_vals[*]} (mean $MEAN_A, spread $(spread "${a_vals[@]}"))"
for s in "${BUDGETS[@]}"; do
  v=(); for seed in "${SEEDS[@]}"; do [ -n "${VAL[muon $LR_M $s $seed]+x}" ] && v+=("${VAL[muon $LR_M $s $seed]}"); done
  if [ ${#v[@]} -eq ${#SEEDS[@]} ]; then
    like=""; for k in "${!SEEDS[@]}"; do le "${v[$k]}" "${a_vals[$k]}" && like+=" ${SEEDS[$k]}:yes" || like+=" ${SEEDS[$k]}:no"; done
    echo "Muon $s steps over seeds ${SEEDS[*]}: ${v[*]} (mean $(mean "${v[@]}"), spread $(spread "${v[@]}")); <= AdamW on like seeds:$like"
  fi
done
if [ -n "$N" ]; then
  a1="seed $SEED0: Muon reaches L_A = $L_A in $N steps ($(awk -v n="$N" -v b=$BASE_STEPS 'BEGIN { printf "%.0f", 100 * n / b }')% of AdamW's $BASE_STEPS)"
else
  a1="seed $SEED0: no Muon budget below $BASE_STEPS reaches L_A = $L_A; Muon at $BASE_STEPS: ${VAL[muon $LR_M $BASE_STEPS $SEED0]}"
fi
if [ -n "$N_MEAN" ]; then
  a2="3-seed means: $N_MEAN steps ($(awk -v n="$N_MEAN" -v b=$BASE_STEPS 'BEGIN { printf "%.0f", 100 * n / b }')%) against AdamW's mean $MEAN_A"
else
  a2="3-seed means: no budget up to $BASE_STEPS reaches AdamW's mean $MEAN_A"
fi
echo "ANSWER: $a1; $a2"
echo "total time ${elapsed}s, logs in $LOG_DIR"
