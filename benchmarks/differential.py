"""run.py and edgeq-run on many generated documents (the suite runs 300 cases: tests/test_differential.py).

Seeded cases (tests/differential.py): PNG/JPEG images and .npy inputs, valid and damaged; manifests with one
field removed or changed; weight and golden tables with a bit flipped, rehashed or not. Each goes to both
loaders of one bundle; the exit status, the answer and the output bytes must agree. Prints the cases per exit
status and every disagreement (exit 1 if there is one).

    python benchmarks/differential.py [--cases 3000] [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import differential  # noqa: E402
from common import report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bundle = differential.package(work)
        cases = differential.cases(args.seed, args.cases, bundle, work / "scratch")
        start = time.perf_counter()

        def progress(done, total):
            if not args.json and (done % 100 == 0 or done == total):
                print(f"\r{done}/{total} cases", end="\n" if done == total else "", file=sys.stderr, flush=True)

        bad, codes = differential.run_cases(bundle, cases, work / "work", progress)
        seconds = time.perf_counter() - start
    kinds = {}
    for case in cases:
        kind = case.name.split()[1]
        kinds[kind] = kinds.get(kind, 0) + 1
    rows = [{"seed": args.seed, "cases": args.cases, "by_kind": kinds,
             "by_exit": {str(k): v for k, v in sorted(codes.items())}, "disagreements": len(bad),
             "seconds": round(seconds, 1)}]
    report("run.py vs edgeq-run on generated documents", rows, args.json)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
