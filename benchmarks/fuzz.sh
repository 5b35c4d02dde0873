#!/usr/bin/env bash
# Fuzz edgeq-run's readers (tests/fuzz/edgeq_run_fuzz.cc: json, manifest, npy, png, jpeg, yolo) with libFuzzer,
# under AddressSanitizer and UndefinedBehaviorSanitizer, for a bounded time per target, then merge what grew
# the coverage into the committed corpus (tests/fuzz/corpus/<target>/), which tests/test_fuzz_corpus.py replays
# under ASan/UBSan in the suite.
#
#   bash benchmarks/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     default 60 s, every target
#   bash benchmarks/fuzz.sh 60 --json                             the figures as JSON
#   bash benchmarks/fuzz.sh 300 --python [TARGET...]              run.py's readers instead (tests/fuzz/run_py_fuzz.py,
#                                                                 Atheris: pip install atheris), seeded by edgeq-run's
#                                                                 corpus; what grows goes to tests/fuzz/corpus-py/
#
# Needs clang with libFuzzer (Debian: apt install clang) and the .venv of scripts/setup.sh. A finding stops
# that target and leaves its input as fuzz-work/<target>/crash-*; the figures list it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECONDS_PER_TARGET=60
JSON=0
PYTHON_TARGETS=0
TARGETS=()
for arg in "$@"; do
    case "$arg" in
        --json) JSON=1 ;;
        --python) PYTHON_TARGETS=1 ;;
        [0-9]*) SECONDS_PER_TARGET=$arg ;;
        json|manifest|npy|png|jpeg|yolo|video) TARGETS+=("$arg") ;;
        *) echo "fuzz.sh: unknown argument '$arg' (seconds, --json, --python, or a target: json manifest npy png jpeg yolo; video with --python)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-.venv/bin/python}
WORK=${FUZZ_WORK:-fuzz-work}  # FUZZ_WORK: another folder, for campaigns side by side
mkdir -p "$WORK"
if [ "$PYTHON_TARGETS" = 1 ]; then
    [ ${#TARGETS[@]} -gt 0 ] || TARGETS=(manifest npy png jpeg yolo video)
    "$PY" -c "import atheris" 2>/dev/null || { echo "fuzz.sh: --python needs Atheris: $PY -m pip install atheris" >&2; exit 2; }
    FUZZER=("$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" "$PWD/tests/fuzz/run_py_fuzz.py")
    CORPORA=tests/fuzz/corpus-py
else
    [ ${#TARGETS[@]} -gt 0 ] || TARGETS=(json manifest npy png jpeg yolo)
    for target in "${TARGETS[@]}"; do
        [ "$target" != video ] || { echo "fuzz.sh: the video target is run.py's (--python)" >&2; exit 2; }
    done
    CXX=${CXX:-clang++}
    command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found; apt install clang" >&2; exit 2; }
    FUZZER=("$PWD/$WORK/edgeq-run-fuzz")
    CORPORA=tests/fuzz/corpus
    "$PY" -c "from edgeq.runtime.assemble import generated_headers
for name, text in generated_headers().items(): open('$WORK/' + name, 'wb').write(text)"
    INCLUDE=$("$PY" -c "from edgeq.runtime.assemble import package_dir; print(package_dir('tvm_ffi') / 'include')")
    if [ ! -d tests/fuzz/corpus/json ]; then "$PY" benchmarks/fuzz_seeds.py >&2; fi
    echo "fuzz.sh: building the libFuzzer targets with $CXX" >&2
    "$CXX" -std=c++17 -O1 -g -ffp-contract=off -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
        -I"$WORK" -Itemplates/native -I"$INCLUDE" tests/fuzz/edgeq_run_fuzz.cc -o "$WORK/edgeq-run-fuzz" -ldl
fi

rows=()
for target in "${TARGETS[@]}"; do
    corpus=$CORPORA/$target
    seeds=()  # run.py's targets start from edgeq-run's corpus too: the same bytes, fed the same way
    [ "$PYTHON_TARGETS" = 1 ] && [ -d "tests/fuzz/corpus/$target" ] && seeds=("$PWD/tests/fuzz/corpus/$target")
    grown=$WORK/$target
    [ "$PYTHON_TARGETS" = 1 ] && grown=$WORK/py-$target
    rm -rf "$grown"
    mkdir -p "$grown" "$corpus"
    before=$(find "$corpus" -type f | wc -l)
    echo "fuzz.sh: $target for ${SECONDS_PER_TARGET} s" >&2
    set +e
    run=("${FUZZER[@]}")  # run.py's fuzzer takes its target as an argument; edgeq-run's from EDGEQ_FUZZ_TARGET
    [ "$PYTHON_TARGETS" = 1 ] && run+=("$target")
    (cd "$grown" && EDGEQ_FUZZ_TARGET=$target "${run[@]}" \
        -max_total_time="$SECONDS_PER_TARGET" -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        . "$ROOT/$corpus" "${seeds[@]}") >"$grown.log" 2>&1
    status=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$grown.log" | tail -1)
    crashes=$(find "$grown" -maxdepth 1 \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
    # keep only what adds coverage: merge the grown inputs (not the findings) into the committed corpus
    mkdir -p "$grown.merge" && find "$grown" -maxdepth 1 -type f ! -name 'crash-*' ! -name 'leak-*' ! -name 'timeout-*' \
        ! -name 'oom-*' -exec cp {} "$grown.merge/" \;
    EDGEQ_FUZZ_TARGET=$target "${run[@]}" -merge=1 "$corpus" "$grown.merge" >"$grown.merge.log" 2>&1 || true
    rm -rf "$grown.merge"
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
