#!/usr/bin/env bash
# Installs, without touching GitHub, the LLVM 23 that Burn's opt-in `cuda` and `cpu` features
# compile against, and points this repository's builds at it.
#
# Why: burn 0.22.1's `cuda`/`cpu` pull in cubecl-llvm, whose build dependency
# tracel-llvm-bundler (23.1.0-4) downloads a prebuilt LLVM from GitHub in its build script. That
# script skips the download when `$XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed`
# exists, and cubecl-llvm then asks `<that dir>/bin/llvm-config` how to link. The PyPI wheels
# `mlc-llvm-static` (a static, position-independent LLVM 23.1.1 with its llvm-config) and
# `mlc-llvm-static-extra-targets` (adds the NVPTX target that `cuda` needs) provide exactly that,
# through pip, which works where GitHub downloads do not. LLVM is linked statically: built
# binaries do not need it at run time.
#
# Usage:   scripts/setup-llvm.sh [DIR]
#   DIR defaults to $BURN_PARALLEL_LLVM, else $HOME/.cache/burn-parallel/llvm (shared by every
#   clone and worktree on the machine: the wheels are large). The script is idempotent.
# Effect:  DIR/sdk (the wheels), DIR/xdg/tracel/tracel-llvm-23.1.0-4 (the layout the bundler
#   expects) and a link `<repo>/.llvm -> DIR`. `.cargo/config.toml` sets
#   XDG_DATA_HOME=<repo>/.llvm/xdg for cargo, so `cargo build --features cuda` then just works.
#   Builds without `cuda`/`cpu` never read XDG_DATA_HOME and need none of this.
# Needs:   python3 >= 3.10 with pip, and network access to PyPI (or a pip mirror).
set -euo pipefail

LLVM_TAG=tracel-llvm-23.1.0-4
WHEEL_VERSION=23.1.1.post0
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-${BURN_PARALLEL_LLVM:-$HOME/.cache/burn-parallel/llvm}}
case "$dir" in
  /*) ;;
  *) dir="$(pwd)/$dir" ;;
esac

marker="$dir/xdg/tracel/$LLVM_TAG/.tracel-llvm-installed"
if [ ! -e "$marker" ]; then
  echo "setup-llvm: installing mlc-llvm-static $WHEEL_VERSION (+ extra targets) into $dir/sdk"
  python3 -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "$dir/sdk" \
    "mlc-llvm-static==$WHEEL_VERSION" "mlc-llvm-static-extra-targets==$WHEEL_VERSION"
  config="$dir/sdk/mlc_llvm_static/static/bin/llvm-config"
  if [ ! -x "$config" ]; then
    echo "setup-llvm: the wheel has no $config; is the wheel layout different?" >&2
    exit 1
  fi
  mkdir -p "$dir/xdg/tracel/$LLVM_TAG/bin"
  ln -sfn "$config" "$dir/xdg/tracel/$LLVM_TAG/bin/llvm-config"
  touch "$marker"
fi

# The link the repository's .cargo/config.toml names (relative, so every clone finds its own).
if [ "$(readlink "$repo/.llvm" 2>/dev/null || true)" != "$dir" ]; then
  rm -f "$repo/.llvm"
  ln -s "$dir" "$repo/.llvm"
fi

echo "setup-llvm: LLVM $("$dir/xdg/tracel/$LLVM_TAG/bin/llvm-config" --version) ready in $dir"
if [ -n "${XDG_DATA_HOME:-}" ] && [ "$XDG_DATA_HOME" != "$repo/.llvm/xdg" ]; then
  echo "setup-llvm: note: XDG_DATA_HOME is set in your environment ($XDG_DATA_HOME) and wins over" \
       ".cargo/config.toml; build with XDG_DATA_HOME=$repo/.llvm/xdg cargo build --features cuda" >&2
fi
