#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, RESHARD_FUZZ=ON) and runs each for a bounded time.
#
#   fuzz/run_fuzzers.sh SECONDS [BUILD_DIR]
#
# Each fuzzer runs over a temporary copy of fuzz/corpus/<name> (the committed corpus is
# never modified). Exits non-zero if any fuzzer finds a crash, a leak, a timeout or an
# out-of-memory; the offending inputs are left in BUILD_DIR/fuzz-artifacts/<name>/ - keep
# them, once fixed, under fuzz/regressions/<name>/.
#
# RESHARD_FUZZ_SEED (default 1) seeds every fuzzer, so a run explores the same inputs first
# and passes or fails on the code rather than on the draw; RESHARD_FUZZ_SEED=random draws a
# fresh seed per fuzzer (printed) to explore further.
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 SECONDS [BUILD_DIR]" >&2
  exit 2
fi
seconds=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${2:-$root/build-fuzz}

if [[ ! -f "$build/build.ninja" ]]; then
  # Through ccache where it is installed, as every other build of scripts/dev: a run after a
  # small change recompiles what changed, not the whole instrumented library.
  launcher=()
  if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DRESHARD_FUZZ=ON "${launcher[@]}" \
    -DRESHARD_BUILD_TESTS=OFF -DRESHARD_BUILD_BENCH=OFF -DRESHARD_BUILD_PYTHON=OFF
fi

names=()
for dir in "$root"/fuzz/corpus/*/; do
  names+=("$(basename "$dir")")
done
targets=()
for name in "${names[@]}"; do targets+=("${name}_fuzzer"); done
ninja -C "$build" "${targets[@]}"

# UndefinedBehaviorSanitizer reports and goes on by default; halting makes undefined
# behaviour (a signed overflow, a bad shift) a failure with its input kept, as a crash is.
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
# One fuzzer run: its corpus (seeds and kept regressions) in the work folder, its log there,
# its crashing inputs in the build's fuzz-artifacts.
run_one() {
  local name=$1 corpus="$work/$1" artifacts="$build/fuzz-artifacts/$1" seed dict=()
  mkdir -p "$corpus" "$artifacts"
  cp -r "$root/fuzz/corpus/$name/." "$corpus/"
  if [[ -d "$root/fuzz/regressions/$name" ]]; then
    cp -r "$root/fuzz/regressions/$name/." "$corpus/"
  fi
  seed=${RESHARD_FUZZ_SEED:-1}
  if [[ "$seed" == random ]]; then seed=$(( (RANDOM << 15 | RANDOM) + 1 )); fi
  echo "$seed" > "$work/$name.seed"
  if [[ -f "$root/fuzz/$name.dict" ]]; then dict=(-dict="$root/fuzz/$name.dict"); fi
  "$build/fuzz/${name}_fuzzer" "${dict[@]}" -seed="$seed" -max_total_time="$seconds" -max_len=4096 \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$artifacts/" "$corpus" \
    > "$work/$name.log" 2>&1
}

# The fuzzers run side by side, RESHARD_JOBS at a time (default 2: one a core), each for the
# full time; their reports follow in order.
parallel=${RESHARD_JOBS:-2}
declare -A pid_of
for name in "${names[@]}"; do
  while (( $(jobs -rp | wc -l) >= parallel )); do wait -n || true; done
  run_one "$name" &
  pid_of[$name]=$!
done
for name in "${names[@]}"; do
  echo "== $name: ${seconds}s, seed $(cat "$work/$name.seed" 2>/dev/null || echo ?)"
  if ! wait "${pid_of[$name]}"; then
    tail -n 60 "$work/$name.log"
    echo "== $name: FAILED; inputs in $build/fuzz-artifacts/$name" >&2
    status=1
  else
    grep -E '^stat::number_of_executed_units|^Done' "$work/$name.log" || true
  fi
done
exit $status
