#!/usr/bin/env bash
# Runs one integration test of the `tests` crate on every SIMD tier that the code picks at run
# time (Burn's Flex backend sums in 16 lanes on AVX-512 and in 8 on AVX2; our CPU kernels and
# `gemm` pick their microkernels the same way): natively (AVX-512 where the CPU has it), then
# under QEMU's user-mode emulation as an AVX2 + FMA CPU (Haswell) and as the x86-64 baseline
# (SSE2). A parity bound that holds on all three does not depend on the machine CI lands on.
#
#   scripts/simd-tiers.sh byo_parity byo_moe_matches_single_device_under_expert_parallelism
#
# Needs Debian's qemu-user (`apt-get install qemu-user`); emulation is about 50 times slower
# than native, so name the tests to run. Exits non-zero when any tier fails.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 TEST [FILTER...]" >&2; exit 2; }
test_name=$1
shift
command -v qemu-x86_64 >/dev/null || { echo "qemu-x86_64 not found: apt-get install qemu-user" >&2; exit 2; }
binary=$(cargo test -p tests --features tests/portable --test "$test_name" --no-run \
  --message-format=json 2>/dev/null | grep -o '"executable":"[^"]*"' | tail -1 | cut -d'"' -f4)
[ -x "$binary" ] || { echo "could not build the test binary of $test_name" >&2; exit 1; }
status=0
for tier in native Haswell-v4 qemu64; do
  echo "== $tier"
  if [ "$tier" = native ]; then
    run=("$binary")
  else
    run=(qemu-x86_64 -cpu "$tier" "$binary")
  fi
  "${run[@]}" "$@" --nocapture --test-threads 1 || status=1
done
exit $status
