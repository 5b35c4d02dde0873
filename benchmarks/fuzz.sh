#!/usr/bin/env bash
# Fuzz edgeq-run's readers (tests/fuzz/edgeq_run_fuzz.cc: json, manifest, npy, png, jpeg, yolo) with libFuzzer,
# under AddressSanitizer and UndefinedBehaviorSanitizer, for a bounded time per target, then merge what grew
# the coverage into the committed corpus (tests/fuzz/corpus/<target>/), which tests/test_fuzz_corpus.py replays
# under ASan/UBSan in the suite.
#
#   bash benchmarks/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     default 60 s, every target
#   bash benchmarks/fuzz.sh 60 --json                             the figures as JSON
#
# Needs clang with libFuzzer (Debian: apt install clang) and the .venv of scripts/setup.sh. A finding stops
# that target and leaves its input as fuzz-work/<target>/crash-*; the figures list it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=60
JSON=0
TARGETS=()
for arg in "$@"; do
    case "$arg" in
        --json) JSON=1 ;;
        [0-9]*) SECONDS_PER_TARGET=$arg ;;
        json|manifest|npy|png|jpeg|yolo) TARGETS+=("$arg") ;;
        *) echo "fuzz.sh: unknown argument '$arg' (seconds, --json, or a target: json manifest npy png jpeg yolo)" >&2; exit 2 ;;
    esac
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(json manifest npy png jpeg yolo)
CXX=${CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found; apt install clang" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
WORK=fuzz-work
mkdir -p "$WORK"
"$PY" -c "from edgeq.runtime.assemble import generated_headers
for name, text in generated_headers().items(): open('$WORK/' + name, 'wb').write(text)"
INCLUDE=$("$PY" -c "from edgeq.runtime.assemble import package_dir; print(package_dir('tvm_ffi') / 'include')")
if [ ! -d tests/fuzz/corpus/json ]; then "$PY" benchmarks/fuzz_seeds.py >&2; fi
echo "fuzz.sh: building the libFuzzer targets with $CXX" >&2
"$CXX" -std=c++17 -O1 -g -ffp-contract=off -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -I"$WORK" -Itemplates/native -I"$INCLUDE" tests/fuzz/edgeq_run_fuzz.cc -o "$WORK/edgeq-run-fuzz" -ldl

rows=()
for target in "${TARGETS[@]}"; do
    corpus=tests/fuzz/corpus/$target
    grown=$WORK/$target
    rm -rf "$grown"
    mkdir -p "$grown" "$corpus"
    before=$(find "$corpus" -type f | wc -l)
    echo "fuzz.sh: $target for ${SECONDS_PER_TARGET} s" >&2
    set +e
    (cd "$grown" && EDGEQ_FUZZ_TARGET=$target ../edgeq-run-fuzz -max_total_time="$SECONDS_PER_TARGET" -max_len=65536 \
        -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 . "../../$corpus") >"$WORK/$target.log" 2>&1
    status=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$WORK/$target.log" | tail -1)
    crashes=$(find "$grown" -maxdepth 1 \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
    # keep only what adds coverage: merge the grown inputs into the committed corpus
    EDGEQ_FUZZ_TARGET=$target "$WORK/edgeq-run-fuzz" -merge=1 "$corpus" "$grown" >"$WORK/$target.merge.log" 2>&1 || true
    after=$(find "$corpus" -type f | wc -l)
    rows+=("$target ${execs:-0} $SECONDS_PER_TARGET $crashes $before $after $status")
done

if [ "$JSON" = 1 ]; then
    printf '%s\n' "${rows[@]}" | "$PY" -c '
import json, sys
keys = ("target", "executions", "seconds", "findings", "corpus_before", "corpus_after", "exit")
print(json.dumps([dict(zip(keys, [r[0]] + [int(v) for v in r[1:]])) for r in (line.split() for line in sys.stdin)], indent=1))'
else
    printf '%-9s %12s %8s %9s %14s\n' target executions seconds findings corpus
    for row in "${rows[@]}"; do
        set -- $row
        printf '%-9s %12s %8s %9s %14s\n' "$1" "$2" "$3" "$4" "$5 -> $6"
    done
fi
