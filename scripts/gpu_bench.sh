#!/usr/bin/env bash
# Issue 25's GPU measurements in one go, on a GPU host, from the repository root, after
# `../shared/tools/gpu-pack.sh .gpu <gpt> [<plain_burn_gpt>]` here:
#
#   bash .gpu/run.sh bash scripts/gpu_bench.sh OUTDIR [SECTION ...]
#
# Everything a run prints that matters goes to OUTDIR/summary.txt as it comes (a session cut
# short still returns what ran), each run's whole log to OUTDIR/logs.tar.gz at the end.
# Sections, in the order given (default: all but `plain`):
#   check    the trainer's default shape, 20 steps, 1 and 2 ranks: f32 and bf16 with the
#            products on cuBLASLt (ordered on the device, and by host syncs), bf16 with
#            attention composed (BURN_PARALLEL_COMPOSED=attention); losses and final parameters compared
#            with scripts/compare_runs.py, and each run's validation loss.
#   cube     the same 20 steps with the products on CubeCL (BURN_PARALLEL_MATMUL=cube;
#            its autotune makes the first step slow).
#   matmul   scripts/torch_matmul.py: cuBLAS's products alone at GPT-2 small's shapes.
#   bf16     scripts/vs_torch.py at GPT-2 small's shape, ours --precision bf16 against torch's
#            bf16 autocast.
#   f32      the same, f32 against torch fp32; then tf32 (ours --tf32) against torch TF32.
#   profile  `gpt --profile` at GPT-2 small's shape, bf16 and f32.
#   default  vs_torch.py at the trainer's default shape, f32.
#   curve    the default shape for 40 steps (past the learning-rate peak at step 19, where even
#            f32 spikes), f32, bf16, and bf16 with the products on CubeCL: the loss curves side
#            by side and each run's validation loss (does bf16 diverge where f32 does not?).
#   plain    vs_torch.py with plain Burn beside (`--plain-burn`), GPT-2 small's shape, f32.
set -u
out=${1:?usage: gpu_bench.sh OUTDIR [SECTION ...]}
shift
sections=${*:-check curve cube matmul bf16 f32 profile default}
mkdir -p "$out/logs"
sum="$out/summary.txt"
note() { echo "== $(date +%T) $*" | tee -a "$sum"; }
GPT=$(command -v gpt) || { echo "gpt is not on PATH (run through .gpu/run.sh)"; exit 2; }
PLAIN=$(command -v plain_burn_gpt || echo "")
G2="--layers 12 --d-model 768 --heads 12 --seq-len 1024 --batch-size 8"
VS="python3 scripts/vs_torch.py --device cuda --layouts 1 --steps 20 --warmup 5 --repeats 1 --our-binary $GPT"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$sum"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$sum"

run() { # name limit command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  note "$name: rc $rc, $((SECONDS - start)) s: ${*#env }"
  grep -aE "tokens/s|ratio|profile|ms/step|^ +[a-z].*ms|MFU|mfu|^ *(gpt2|default)|error|panicked|warning" \
    "$out/logs/$name.log" | grep -av "^step" | cut -c1-400 | tail -30 >>"$sum"
}

check() { # tag ranks precision env...
  local tag=$1 ranks=$2 prec=$3; shift 3
  run "$tag" 60 env "$@" "$GPT" --device cuda --ranks "$ranks" --precision "$prec" --steps 20 \
    --log-every 100 --losses-out "$out/logs/losses_$tag.json" \
    --params-out "$out/logs/params_$tag.json"
}

compare() { # reference tag, other tags...
  local args=()
  for t in "$@"; do args+=("$out/logs/losses_$t.json" "$out/logs/params_$t.json"); done
  python3 scripts/compare_runs.py "${args[@]}" 2>&1 | tee -a "$sum"
}

for section in $sections; do
  case $section in
    check)
      check f32_r1 1 f32
      check bf16_r1 1 bf16
      check bf16_r1_sync 1 bf16 BURN_PARALLEL_CUBLAS_ORDER=sync
      check bf16_r1_noflash 1 bf16 BURN_PARALLEL_COMPOSED=attention
      check f32_r2 2 f32
      check bf16_r2 2 bf16
      check bf16_r2_noflash 2 bf16 BURN_PARALLEL_COMPOSED=attention
      compare f32_r1 bf16_r1 bf16_r1_sync bf16_r1_noflash f32_r2 bf16_r2 bf16_r2_noflash
      ;;
    cube)
      check f32_r1_cube 1 f32 BURN_PARALLEL_MATMUL=cube
      check bf16_r1_cube 1 bf16 BURN_PARALLEL_MATMUL=cube
      compare f32_r1 f32_r1_cube bf16_r1_cube
      ;;
    matmul) run torch_matmul 60 python3 scripts/torch_matmul.py --rows 8192 --d-model 768 --layers 12
      cat "$out/logs/torch_matmul.log" >>"$sum" ;;
    bf16) run vs_bf16_gpt2 150 $VS --precision bf16 --shapes gpt2 ;;
    f32)
      run vs_f32_gpt2 150 $VS --precision f32 --shapes gpt2
      run vs_tf32_gpt2 150 $VS --precision tf32 --shapes gpt2 --extra-args=--tf32
      ;;
    profile)
      run profile_bf16 90 "$GPT" --device cuda --ranks 1 --precision bf16 $G2 --steps 12 --profile
      run profile_f32 90 "$GPT" --device cuda --ranks 1 --precision f32 $G2 --steps 12 --profile
      ;;
    default) run vs_f32_default 90 $VS --precision f32 --shapes default ;;
    curve)
      for tag in f32 bf16 bf16_cube; do
        env=()
        [ "$tag" = bf16_cube ] && env=(BURN_PARALLEL_MATMUL=cube)
        run "curve_$tag" 150 env "${env[@]}" "$GPT" --device cuda --ranks 1 \
          --precision "${tag%_cube}" --steps 40 --log-every 100 \
          --losses-out "$out/logs/curve_$tag.json"
      done
      python3 - "$out/logs" <<'PY' | tee -a "$sum"
import json, os, sys
tags = ["f32", "bf16", "bf16_cube"]
curves = {}
for t in tags:
    path = os.path.join(sys.argv[1], f"curve_{t}.json")
    if os.path.exists(path):
        curves[t] = json.load(open(path))
print("step " + " ".join(f"{t:>9}" for t in curves))
for i in range(max(map(len, curves.values()), default=0)):
    print(f"{i:4} " + " ".join(f"{c[i]:9.4f}" if i < len(c) else " " * 9 for c in curves.values()))
PY
      ;;
    plain) [ -n "$PLAIN" ] && run vs_plain_gpt2 300 $VS --precision f32 --shapes gpt2 \
      --plain-burn --plain-binary "$PLAIN" ;;
    *) note "unknown section $section" ;;
  esac
done
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
note done
