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
#   layouts  the precision policy under every layout of the trainer (issue 26), thread ranks
#            sharing the GPU, the default shape, 20 steps: bf16 on one device, under ZeRO-1,
#            ZeRO-2 with fp32 reduction, FSDP, tp 2 + SP and pp 2 against fp32; fp16 (dynamic
#            loss scaling) on one device and pp 2; and each pipeline against the single device
#            in its precision on the same micro-batches (--grad-accum 4).
#   clip     f32, bf16, fp16 and bf16 under pp 2, tp 2 + SP and FSDP, 20 steps with --clip 1.0:
#            the validation losses side by side.
#   clip2    the same for ZeRO-1, ZeRO-2 with fp32 reduction, cp 2, fp16 pp 2, and a GPT-MoE at
#            ep 2 in f32, bf16 and fp16.
#   ws1      step time at world size 1 (GPT-2 small's shape, bf16, 12 steps): no backend,
#            `--backend tcp`, `--backend nccl` (one process, RANK 0 of 1); then DDP over 2
#            processes on cuda:0 through `--backend tcp` (device tensors, host transport):
#            the baselines of issue 27.
#   i27      issue 27's figures, GPT-2 small's shape, ${I27_STEPS:-30} steps logged one by one
#            with --profile (the summary gives each run's median step from step 10 on):
#            plain single-device training against `--backend nccl --overlap` at world size 1
#            (the overlapped DDP wrapper: hooks, device buckets, NCCL all-reduces waited on
#            the device; its NCCL trace read by scripts/nccl_trace.py) in f32 and bf16; two
#            processes on cuda:0 over `--backend tcp` with --overlap (device tensors, host
#            transport; I27_TCP=none skips them, I27_OVERLAP=0 the overlapped runs). I27_FSDP=1
#            adds `--zero 3` without and with --prefetch, I27_ZERO=1 `--zero 1` and `--zero 2`
#            (and the same with `gpt_before`, when on PATH; I27_ZERO=bf16 adds `--zero 2` in
#            bf16 against plain bf16). First the NCCL device tests when
#            the `nccl` test binary is on PATH (run through both packs: bash .gpu/run.sh bash
#            .gpun/run.sh bash scripts/gpu_bench.sh OUT i27) with BURN_PARALLEL_REQUIRE_CUDA=1,
#            the device-side wait's test first.
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
  grep -aE "tokens/s|ratio|profile|ms/step|host transport|^ +[a-z].*ms|MFU|mfu|^ *(gpt2|default)|error|panicked|warning|loss scaling" \
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

clipped() { # tag ranks precision flags...: 20 steps with --clip 1.0
  local tag=$1 ranks=$2 prec=$3; shift 3
  run "clip_$tag" 120 "$GPT" --device cuda --ranks "$ranks" --precision "$prec" --steps 20 \
    --clip 1.0 --log-every 100 --losses-out "$out/logs/losses_clip_$tag.json" \
    --params-out "$out/logs/params_clip_$tag.json" "$@"
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
      for tag in ${CURVE_TAGS:-f32 bf16 bf16_cube}; do
        env=()
        [ "$tag" = bf16_cube ] && env=(BURN_PARALLEL_MATMUL=cube)
        run "curve_$tag" 150 env "${env[@]}" "$GPT" --device cuda --ranks 1 \
          --precision "${tag%_cube}" --steps 40 --log-every 100 \
          --losses-out "$out/logs/curve_$tag.json"
      done
      python3 - "$out/logs" <<'PY' | tee -a "$sum"
import json, os, sys
tags = os.environ.get("CURVE_TAGS", "f32 bf16 bf16_cube").split()
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
    layouts)
      lay() { # tag ranks precision flags...
        local tag=$1 ranks=$2 prec=$3; shift 3
        run "lay_$tag" 120 "$GPT" --device cuda --ranks "$ranks" --precision "$prec" --steps 20 \
          --log-every 100 --losses-out "$out/logs/losses_lay_$tag.json" \
          --params-out "$out/logs/params_lay_$tag.json" "$@"
      }
      lay f32 1 f32
      lay bf16 1 bf16
      lay bf16_zero1 2 bf16 --zero 1
      lay bf16_zero2_reduce_fp32 2 bf16 --zero 2 --reduce-fp32
      lay bf16_fsdp 2 bf16 --zero 3
      lay bf16_tp2_sp 2 bf16 --tp 2 --sp
      lay bf16_pp2 2 bf16 --pp 2
      lay bf16_accum4 1 bf16 --grad-accum 4
      lay fp16 1 fp16
      lay fp16_pp2 2 fp16 --pp 2
      lay fp16_accum4 1 fp16 --grad-accum 4
      note "against fp32 on one device"
      compare lay_f32 lay_bf16 lay_bf16_zero1 lay_bf16_zero2_reduce_fp32 lay_bf16_fsdp \
        lay_bf16_tp2_sp lay_bf16_pp2 lay_fp16 lay_fp16_pp2
      note "pp 2 against one device in the same precision on the same micro-batches"
      compare lay_bf16_accum4 lay_bf16_pp2
      compare lay_fp16_accum4 lay_fp16_pp2
      rm -f "$out"/logs/params_lay_*.json # compared here; too large to bring back
      ;;
    clip)
      # The layouts' validation with global-norm clipping at 1.0 (Megatron-LM's and torchtitan's
      # default): does half precision validate as fp32 once the step-20 learning-rate peak is
      # tamed (see README, "Half precision at the default shape")?
      clipped f32 1 f32
      clipped bf16 1 bf16
      clipped fp16 1 fp16
      clipped bf16_pp2 2 bf16 --pp 2
      clipped bf16_tp2_sp 2 bf16 --tp 2 --sp
      clipped bf16_fsdp 2 bf16 --zero 3
      compare clip_f32 clip_bf16 clip_fp16 clip_bf16_pp2 clip_bf16_tp2_sp clip_bf16_fsdp
      rm -f "$out"/logs/params_clip_*.json
      ;;
    clip2)
      # The rest of the layouts, as `clip`: ZeRO-1/2, context parallelism, fp16 pipeline, and
      # a GPT-MoE (ep 2) against its own fp32 run.
      clipped f32 1 f32
      clipped bf16_zero1 2 bf16 --zero 1
      clipped bf16_zero2_reduce_fp32 2 bf16 --zero 2 --reduce-fp32
      clipped bf16_cp2 2 bf16 --cp 2
      clipped fp16_pp2 2 fp16 --pp 2
      compare clip_f32 clip_bf16_zero1 clip_bf16_zero2_reduce_fp32 clip_bf16_cp2 clip_fp16_pp2
      clipped f32_moe 2 f32 --moe-experts 4 --ep 2
      clipped bf16_moe 2 bf16 --moe-experts 4 --ep 2
      clipped fp16_moe 2 fp16 --moe-experts 4 --ep 2
      compare clip_f32_moe clip_bf16_moe clip_fp16_moe
      rm -f "$out"/logs/params_clip_*.json
      ;;
    ws1)
      W1="--device cuda --precision bf16 $G2 --steps 12 --log-every 100"
      export MASTER_ADDR=127.0.0.1 LOCAL_RANK=0
      run ws1_local 120 "$GPT" --ranks 1 $W1
      run ws1_tcp 120 env RANK=0 WORLD_SIZE=1 MASTER_PORT=29611 "$GPT" --backend tcp $W1
      run ws1_nccl 120 env RANK=0 WORLD_SIZE=1 MASTER_PORT=29612 "$GPT" --backend nccl $W1
      # Two processes on one GPU over TCP: DDP with device tensors and a host transport.
      start=$SECONDS
      RANK=1 WORLD_SIZE=2 MASTER_PORT=29613 timeout 150 "$GPT" --backend tcp $W1 \
        >"$out/logs/ws2_tcp_rank1.log" 2>&1 &
      run ws2_tcp 150 env RANK=0 WORLD_SIZE=2 MASTER_PORT=29613 "$GPT" --backend tcp $W1
      wait
      ;;
    i27)
      # Each run's per-step losses: the overlapped runs must train as the plain ones do.
      F="--device cuda --precision f32 $G2 --steps ${I27_STEPS:-30} --log-every 1 --profile"
      B="${F/--precision f32/--precision bf16}"
      export MASTER_ADDR=127.0.0.1 LOCAL_RANK=0 CUDA_VISIBLE_DEVICES=0
      L() { echo "--losses-out $out/logs/losses_$1.json"; }
      # The device tests first (when the `nccl` test binary is on PATH too: nest the two
      # packs' run.sh), the device-side wait's own test before the rest: the overlapped runs
      # wait on the device, so they are skipped when that test did not pass.
      NCCLT=$(command -v nccl || echo "")
      ok=1
      if [ -n "$NCCLT" ]; then
        run i27_nccl_wait_test 90 env BURN_PARALLEL_REQUIRE_CUDA=1 "$NCCLT" --test-threads 1 \
          --nocapture device_side_waits
        grep -q "test result: ok. 1 passed" "$out/logs/i27_nccl_wait_test.log" || ok=0
        run i27_nccl_tests 240 env BURN_PARALLEL_REQUIRE_CUDA=1 "$NCCLT" --test-threads 1 \
          --skip device_side_waits
        grep -aE "^test |test result" "$out/logs/i27_nccl_wait_test.log" \
          "$out/logs/i27_nccl_tests.log" | cut -c1-200 >>"$sum"
      fi
      run i27_plain 150 "$GPT" --ranks 1 $F $(L plain)
      [ "${I27_OVERLAP:-1}" = 0 ] && ok=0
      [ $ok = 1 ] && run i27_nccl_overlap 150 env RANK=0 WORLD_SIZE=1 MASTER_PORT=29621 \
        BURN_PARALLEL_NCCL_TRACE="$out/logs/nccl_trace.jsonl" "$GPT" --backend nccl --overlap \
        $F $(L nccl_overlap)
      [ -s "$out/logs/nccl_trace.jsonl" ] && python3 scripts/nccl_trace.py \
        "$out/logs/nccl_trace.jsonl" --perfetto "$out/nccl_trace_perfetto.json" 2>&1 \
        | tail -4 | tee -a "$sum"
      [ $ok = 1 ] && run i27_plain_bf16 150 "$GPT" --ranks 1 $B $(L plain_bf16)
      [ $ok = 1 ] && run i27_nccl_overlap_bf16 150 env RANK=0 WORLD_SIZE=1 MASTER_PORT=29624 \
        "$GPT" --backend nccl --overlap $B $(L nccl_overlap_bf16)
      # I27_FSDP=1: FSDP (--zero 3) on NCCL at world size 1, without and with --prefetch (the
      # next unit's all-gather started asynchronously).
      if [ -n "${I27_FSDP:-}" ]; then
        for p in "" --prefetch; do
          run i27_nccl_zero3${p:+_prefetch} 150 env RANK=0 WORLD_SIZE=1 MASTER_PORT=29625 \
            "$GPT" --backend nccl --zero 3 $p $F $(L nccl_zero3${p:+_prefetch})
        done
      fi
      # I27_ZERO=1: ZeRO-1 and ZeRO-2 on NCCL at world size 1 (flat gradient, bucketed
      # reduce-scatter, update and all-gather in device memory), and the same with the binary
      # of before that change when `gpt_before` is on PATH (pack it beside gpt).
      if [ -n "${I27_ZERO:-}" ]; then
        BEFORE=$(command -v gpt_before || echo "")
        for z in 1 2; do
          for bin in "$GPT" $BEFORE; do
            tag=nccl_zero$z; [ "$bin" = "$GPT" ] || tag=${tag}_before
            run "i27_$tag" 150 env RANK=0 WORLD_SIZE=1 MASTER_PORT=29626 "$bin" --backend nccl \
              --zero $z $F $(L $tag)
          done
        done
        # I27_ZERO=bf16: ZeRO-2 in bf16 too (fp32 master shard), against plain bf16.
        if [ "$I27_ZERO" = bf16 ]; then
          [ -s "$out/logs/losses_plain_bf16.json" ] || run i27_plain_bf16 150 "$GPT" --ranks 1 \
            $B $(L plain_bf16)
          run i27_nccl_zero2_bf16 150 env RANK=0 WORLD_SIZE=1 MASTER_PORT=29627 "$GPT" \
            --backend nccl --zero 2 $B $(L nccl_zero2_bf16)
        fi
      fi
      for o in ${I27_TCP:---overlap}; do
        [ "$o" = none ] && continue
        [ "$o" = plain ] && o=""
        tag=i27_ws2_tcp${o:+_overlap}
        RANK=1 WORLD_SIZE=2 MASTER_PORT=29623 timeout 150 "$GPT" --backend tcp $o $F \
          >"$out/logs/${tag}_rank1.log" 2>&1 &
        run "$tag" 150 env RANK=0 WORLD_SIZE=2 MASTER_PORT=29623 "$GPT" --backend tcp $o $F \
          $(L "${tag#i27_}")
        wait
      done
      python3 - "$out/logs" <<'PY' | tee -a "$sum"
import json, os, sys
d = sys.argv[1]
def load(t):
    p = os.path.join(d, f"losses_{t}.json")
    return json.load(open(p)) if os.path.exists(p) else None
for ref, others in [("plain", ["nccl_overlap", "ws2_tcp_overlap", "nccl_zero3", "nccl_zero3_prefetch", "nccl_zero1", "nccl_zero2", "nccl_zero1_before", "nccl_zero2_before"]), ("plain_bf16", ["nccl_overlap_bf16", "nccl_zero2_bf16"])]:
    a = load(ref)
    for t in others:
        b = load(t)
        if a and b:
            worst = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
            print(f"losses {t} vs {ref}: {len(b)} steps, largest relative difference {worst:.2e}, final {b[-1]:.5f} vs {a[-1]:.5f}")
# Steady state: the median step time over the steps from the tenth on (the first steps compile
# and autotune kernels, more of them with the overlapped path's bucket shapes).
import re, statistics
def steady(t):
    p = os.path.join(d, f"i27_{t}.log")
    if not os.path.exists(p):
        return None
    ms = [8192e3 / float(m.group(2)) for m in re.finditer(r"^step +(\d+) .*? ([\d.]+) tok/s", open(p).read(), re.M) if int(m.group(1)) >= 10]
    return statistics.median(ms) if ms else None
for ref, t in [("plain", "nccl_overlap"), ("plain_bf16", "nccl_overlap_bf16"), ("plain", "nccl_zero3"), ("plain", "nccl_zero3_prefetch"), ("nccl_zero3", "nccl_zero3_prefetch"), ("plain", "nccl_zero1"), ("plain", "nccl_zero2"), ("plain", "nccl_zero1_before"), ("plain", "nccl_zero2_before"), ("nccl_zero1_before", "nccl_zero1"), ("nccl_zero2_before", "nccl_zero2"), ("plain_bf16", "nccl_zero2_bf16")]:
    a, b = steady(ref), steady(t)
    if a and b:
        print(f"steady state (median of steps >= 10): {t} {b:.1f} ms/step vs {ref} {a:.1f}: overhead {100 * (b / a - 1):+.1f}%")
PY
      ;;
    plain) [ -n "$PLAIN" ] && run vs_plain_gpt2 300 $VS --precision f32 --shapes gpt2 \
      --plain-burn --plain-binary "$PLAIN" ;;
    *) note "unknown section $section" ;;
  esac
done
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
note done
