"""ONNX's backend node tests through edgeq (host bundle, fp32) and through ONNX Runtime, side by side.

Which tests. onnx 1.23's wheel no longer ships ``onnx/backend/test/data/node``; the code that writes that
folder, ``onnx.backend.test.case.node``, still makes every case: ``collect_testcases()`` imports its
modules in alphabetical order and runs each op's ``export*`` functions in the order they are defined
(numpy seeded with 0 before each), and every ``expect(node, inputs, outputs, name)`` call adds a case
(a one-node model, its inputs and expected outputs, rtol 1e-3 and atol 1e-7), followed by the case's
function-expanded variants (``*_expanded*``). One test per op type: for every op type of the default
ONNX domain and of ``ai.onnx.preview`` (classical ML ``ai.onnx.ml`` and training
``ai.onnx.preview.training`` are left out: not what edgeq packages), the first case in that order that is
not an expanded variant. With onnx 1.23 that is 190 tests (``--verbose`` lists their names). A numpy
scalar in a case's data stands for a 0-d tensor and is given to both runtimes as one.

Per test, in a child process with a time limit (so a hang or a segfault costs that test only):

- edgeq: the model is packaged for ``host`` in fp32 (``edgeq.package.package``, ``runtime="none"``), the
  bundle is loaded by its own ``run.py`` (``run.Model``, as on a device) and run on the test's inputs;
- ONNX Runtime: ``InferenceSession`` on the CPU provider, run on the same inputs.

Each result is compared with the expected outputs the way ONNX's backend runner does
(``onnx.backend.test.runner.Runner.assert_similar_outputs``): same number of outputs, same shapes, same
dtypes, ``np.testing.assert_allclose`` with the case's rtol/atol (1e-3 / 1e-7), NaN equal to NaN. Classes:

- ``pass``: every output matches;
- ``wrong``: the model ran and an output differs (values, shape, dtype or count);
- ``refused``: edgeq raised one of its own errors (``edgeq.errors.EdgeqError``) with a one-line message,
  or ONNX Runtime raised while loading or running the model;
- ``crash``: anything else: another exception (an internal error), a multi-line EdgeqError, a child that
  died on a signal or ran past ``--timeout``.

Shape-like operands. The node tests feed operands such as Reshape's shape, Slice's starts, TopK's k or
Pad's pads as graph inputs, where exported models have constants. Such an operand is bound to the test's
value with ``PackageArgs.consts`` (``--const NAME=FILE.npy``), and the bundle takes the remaining inputs:
an input is bound when it feeds an operand that sets a shape, listed by position in
``edgeq.load.SHAPE_OPERANDS`` (what edgeq's own refusals point at), or an operand that ONNX defines as an
input but that is an attribute in substance, listed in ``ATTRIBUTE_OPERANDS`` below (a window's size,
CumProd's axis, Col2Im's image and block shapes, Compress's condition, ...). Nothing else is bound: data
operands (Gather's indices, Clip's 0-d min/max, QuantizeLinear's scale) stay inputs of the bundle.

    python benchmarks/node_tests.py [--verbose] [--json] [--jobs N] [--timeout S] [--ops Add,Clip] [--no-ort]
                                    [--every-case]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

CLASSES = ("pass", "wrong", "refused", "crash")
# Operands that are attributes in substance (positions), besides edgeq.load.SHAPE_OPERANDS
ATTRIBUTE_OPERANDS = {
    "AffineGrid": (1,), "Col2Im": (1, 2), "Compress": (1,), "CumProd": (1,), "HannWindow": (0,),
    "HammingWindow": (0,), "BlackmanWindow": (0,), "MelWeightMatrix": (0, 1, 2, 3, 4), "DFT": (1, 2),
    "STFT": (1, 3), "SplitToSequence": (1,),
}
LEFT_OUT_DOMAINS = ("ai.onnx.ml", "ai.onnx.preview.training")
RUNNERS = ("edgeq", "onnxruntime")
# edgeq run the way a user without --const runs it: shape operands that are graph inputs left unbound
NO_CONST = "edgeq-no-const"


@dataclasses.dataclass
class NodeTest:
    op: str
    name: str
    model: object  # onnx.ModelProto
    inputs: list  # by the model's graph inputs, in order
    outputs: list  # expected, by the model's graph outputs, in order
    rtol: float
    atol: float


@dataclasses.dataclass
class Result:
    cls: str
    message: str = ""
    seconds: float = 0.0


def node_tests(ops: set[str] | None = None, every_case: bool = False) -> list[NodeTest]:
    """The representative test of every op type (see the module docstring for how it is chosen); with
    ``every_case``, all of their (non-expanded) cases."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    chosen: dict[str, NodeTest] = {}
    for case in cases:
        if "_expanded" in case.name or len(case.model.graph.node) != 1:
            continue
        node = case.model.graph.node[0]
        key = case.name if every_case else node.op_type
        if node.domain in LEFT_OUT_DOMAINS or key in chosen or (ops and node.op_type not in ops):
            continue
        inputs, outputs = case.data_sets[0]
        chosen[key] = NodeTest(node.op_type, case.name, case.model, [_value(x) for x in inputs],
                               [_value(x) for x in outputs], case.rtol, case.atol)
    return list(chosen.values())


def _value(x):
    """A test value as numpy (TensorProto -> array; sequences stay lists)."""
    from onnx import TensorProto, numpy_helper

    if isinstance(x, TensorProto):
        return numpy_helper.to_array(x)
    if isinstance(x, list):
        return [_value(v) for v in x]
    if isinstance(x, np.generic):  # a numpy scalar stands for a 0-d tensor
        return np.asarray(x)
    return x


def compare(expected: list, got: list, rtol: float, atol: float) -> str | None:
    """None when ``got`` matches ``expected`` as ONNX's backend runner checks it, else what differs."""
    if len(got) != len(expected):
        return f"{len(got)} outputs, expected {len(expected)}"
    for i, (want, have) in enumerate(zip(expected, got)):
        if isinstance(want, list):
            if not isinstance(have, list):
                return f"output {i} is {type(have).__name__}, expected a sequence"
            problem = compare(want, have, rtol, atol)
            if problem:
                return f"output {i}: {problem}"
            continue
        want, have = np.asarray(want), np.asarray(have)
        if want.shape != have.shape:
            return f"output {i} has shape {have.shape}, expected {want.shape}"
        if want.dtype != have.dtype:
            return f"output {i} is {have.dtype}, expected {want.dtype}"
        try:
            if want.dtype == object:
                np.testing.assert_array_equal(have, want)
            else:
                np.testing.assert_allclose(have, want, rtol=rtol, atol=atol)
        except AssertionError:
            with np.errstate(all="ignore"):
                diff = np.abs(have.astype(np.float64) - want.astype(np.float64)) if want.dtype != object else None
            worst = f" (max |diff| {np.nanmax(diff):.3g})" if diff is not None and diff.size else ""
            return f"output {i} differs{worst}"
    return None


def real_rows(spec, outputs: dict[str, np.ndarray]) -> np.ndarray:
    """An output as ONNX defines it: a padded one (NonMaxSuppression's rows, ``edgeq.nms``) cut to the rows
    its count output says are real."""
    value = outputs[spec.name]
    real = spec.real_rows(outputs)
    if real is None:
        return value
    cut = [slice(None)] * value.ndim
    cut[spec.rows.axis] = slice(0, real)
    return value[tuple(cut)]


def bound_inputs(test: NodeTest) -> dict[str, np.ndarray]:
    """The graph inputs bound as constants: those feeding a shape or attribute-like operand."""
    from edgeq.load import SHAPE_OPERANDS

    node = test.model.graph.node[0]
    positions = set(SHAPE_OPERANDS.get(node.op_type, ())) | set(ATTRIBUTE_OPERANDS.get(node.op_type, ()))
    operands = {name for i, name in enumerate(node.input) if i in positions and name}
    names = [i.name for i in test.model.graph.input]
    return {name: value for name, value in zip(names, test.inputs) if name in operands and isinstance(value, np.ndarray)}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


# ----------------------------------------------------------------------------------------------- runners


def run_edgeq(test: NodeTest, workdir: Path, bind: bool = True) -> Result:
    """Package for host (fp32), load the bundle with its run.py, run the test's inputs, compare. ``bind``:
    shape operands fed as graph inputs are bound with --const (else left as a user without it leaves them)."""
    from common import bundle_model

    from edgeq.errors import EdgeqError
    from edgeq.package import PackageArgs, package

    model_path = workdir / f"{test.name}.onnx"
    model_path.write_bytes(test.model.SerializeToString())
    args = PackageArgs(model=model_path, device="host", output=workdir / "out", runtime="none", name=test.name)
    bound = bound_inputs(test) if bind else {}
    for i, (name, value) in enumerate(bound.items()):
        args.consts[name] = workdir / f"const{i}.npy"
        np.save(args.consts[name], value)
    try:
        try:
            result = package(args)
        except EdgeqError as err:
            feeds = {i.name: v for i, v in zip(test.model.graph.input, test.inputs) if i.name not in bound}
            if "cannot run the generated golden input" not in str(err) or not feeds:
                raise
            # as the message says: the test's own inputs, which the operator is defined on, as the golden input
            # (a generated one may not be: NonMaxSuppression's iou_threshold drawn below 0)
            args = dataclasses.replace(args, golden_input=workdir / "golden.npz")
            np.savez(args.golden_input, **feeds)
            result = package(args)
    except EdgeqError as err:
        message = str(err)
        if "\n" in message.strip() or not message.strip():
            return Result("crash", f"{type(err).__name__} not one line: {message.strip()[:200]!r}")
        return Result("refused", message)
    except Exception as err:  # noqa: BLE001 - what an internal error is
        return Result("crash", f"package: internal error: {_first_line(err)}")
    try:
        model = bundle_model(result.bundle_dir)
        names = [i.name for i in test.model.graph.input]
        feeds = {n: v for n, v in zip(names, test.inputs) if n not in bound}
        outputs = model.run(feeds)
        specs = {spec.name: spec for spec in model.manifest.outputs}
        got = [real_rows(specs[o.name], outputs) if o.name in specs else None for o in test.model.graph.output]
    except Exception as err:  # noqa: BLE001
        return Result("crash", f"run: {_first_line(err)}")
    if any(g is None for g in got):
        return Result("wrong", "the bundle lacks an output")
    problem = compare(test.outputs, got, test.rtol, test.atol)
    return Result("wrong", problem) if problem else Result("pass")


def run_onnxruntime(test: NodeTest, workdir: Path) -> Result:
    from edgeq.reference import onnxruntime_session

    try:
        session = onnxruntime_session(test.model, threads=1, quiet=False)
        feeds = {i.name: v for i, v in zip(session.get_inputs(), test.inputs)}
        got = session.run(None, feeds)
    except Exception as err:  # noqa: BLE001 - ORT's own errors
        return Result("refused", _first_line(err))
    problem = compare(test.outputs, got, test.rtol, test.atol)
    return Result("wrong", problem) if problem else Result("pass")


RUN = {"edgeq": run_edgeq, "onnxruntime": run_onnxruntime, NO_CONST: lambda test, workdir: run_edgeq(test, workdir, bind=False)}


def names_its_input(test: NodeTest, result: Result) -> bool:
    """A refusal that says which graph input to bind: ``--const NAME=FILE.npy`` with one of the test's inputs."""
    names = {i.name for i in test.model.graph.input}
    return result.cls == "refused" and any(f"--const {n}=FILE.npy" in result.message for n in names)


def _child(runner: str, test: NodeTest, workdir: Path) -> None:
    """In the child: the output goes to a log file, the result to result.pkl."""
    log = os.open(workdir / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    start = time.perf_counter()
    try:
        result = RUN[runner](test, workdir)
    except BaseException as err:  # noqa: BLE001
        result = Result("crash", f"harness: {_first_line(err)}")
    result.seconds = time.perf_counter() - start
    (workdir / "result.pkl").write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _died(workdir: Path, code: int | None) -> Result:
    why = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
    tail = ""
    log = workdir / "log.txt"
    if log.is_file():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        checks = [line for line in lines if "Check failed" in line or "Error" in line]
        tail = (checks or lines or [""])[-1].strip()[:200]
    return Result("crash", f"{why}{': ' + tail if tail else ''}")


def run_all(tests: list[NodeTest], runners: list[str], jobs: int, timeout: float,
            progress=None) -> dict[str, dict[str, Result]]:
    """{test name: {runner: Result}}, each (test, runner) in its own child process, ``jobs`` at a time.

    Children are forked from a fork server that imported edgeq, TVM and ONNX Runtime once and never ran
    anything (not from this process: one that has run TVM holds its thread pool's locks, and a child forked
    from it can hang)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["edgeq.toolchain", "edgeq.package", "edgeq.onnx_ops", "onnxruntime", "numpy", "onnx",
                                __name__])
    results: dict[str, dict[str, Result]] = {t.name: {} for t in tests}
    todo = [(t, r) for t in tests for r in runners]
    running: list = []
    with tempfile.TemporaryDirectory(prefix="edgeq-node-tests-") as tmp:
        while todo or running:
            while todo and len(running) < jobs:
                test, runner = todo.pop(0)
                workdir = Path(tmp) / f"{test.name}-{runner}"
                workdir.mkdir()
                proc = ctx.Process(target=_child, args=(runner, test, workdir), daemon=True)
                proc.start()
                running.append((proc, test, runner, workdir, time.monotonic()))
            time.sleep(0.05)
            for item in list(running):
                proc, test, runner, workdir, started = item
                if proc.is_alive() and time.monotonic() - started < timeout:
                    continue
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                    result = Result("crash", f"no result after {timeout:.0f} s (killed)", timeout)
                else:
                    proc.join()
                    path = workdir / "result.pkl"
                    result = pickle.loads(path.read_bytes()) if path.is_file() else _died(workdir, proc.exitcode)
                    if not path.is_file():
                        result.seconds = time.monotonic() - started
                running.remove(item)
                results[test.name][runner] = result
                if progress:
                    progress(test, runner, result)
    return results


# ----------------------------------------------------------------------------------------------- report


def counts(tests: list[NodeTest], results: dict, runner: str) -> dict[str, int]:
    out = dict.fromkeys(CLASSES, 0)
    for t in tests:
        if runner in results[t.name]:
            out[results[t.name][runner].cls] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per test")
    parser.add_argument("--json", action="store_true", help="counts and per-test results as JSON")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, help="tests at a time (default: CPUs)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test and runner (default 300)")
    parser.add_argument("--ops", help="only these op types, comma-separated")
    parser.add_argument("--no-ort", action="store_true", help="edgeq only")
    parser.add_argument("--no-const", action="store_true",
                        help="also run edgeq without binding shape operands (as a user without --const): its refusals "
                             "should name the input to bind")
    parser.add_argument("--every-case", action="store_true",
                        help="every (non-expanded) case of the chosen op types, not one per type")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        parser.error("--jobs and --timeout must be positive")
    ops = set(args.ops.split(",")) if args.ops else None
    tests = node_tests(ops, args.every_case)
    if ops and len({t.op for t in tests}) != len(ops):
        parser.error(f"no node test for: {', '.join(sorted(ops - {t.op for t in tests}))}")
    runners = ["edgeq"] if args.no_ort else list(RUNNERS)
    if args.no_const:
        runners.insert(1, NO_CONST)

    def progress(test, runner, result):
        done = results_so_far.setdefault(test.name, {})
        done[runner] = result
        if args.verbose and not args.json and len(done) == len(runners):
            print(results_line(test, done, runners), flush=True)

    results_so_far: dict = {}
    start = time.perf_counter()
    results = run_all(tests, runners, args.jobs, args.timeout, progress)
    table = {r: counts(tests, results, r) for r in runners}
    named = sum(names_its_input(t, results[t.name][NO_CONST]) for t in tests) if args.no_const else None
    if args.json:
        print(json.dumps({
            "tests": len(tests),
            "counts": table,
            "no_const_refusals_naming_their_input": named,
            "results": [{"op": t.op, "test": t.name, **{r: dataclasses.asdict(results[t.name][r]) for r in runners}}
                        for t in tests],
            "seconds": round(time.perf_counter() - start, 1),
        }, indent=1))
        return 0
    print(f"\nONNX backend node tests, one per op type: {len(tests)} tests in {time.perf_counter() - start:.0f} s")
    print(f"{'':10}" + "".join(f"{r:>{max(13, len(r) + 2)}}" for r in runners))
    for cls in CLASSES:
        print(f"{cls:10}" + "".join(f"{table[r][cls]:>{max(13, len(r) + 2)}}" for r in runners))
    if named is not None:
        print(f"{NO_CONST}: {named} of its {table[NO_CONST]['refused']} refusals name the graph input to bind")
    return 0


def results_line(test: NodeTest, results: dict, runners: list[str]) -> str:
    parts = [f"{test.op:28} {test.name:52}"]
    for r in runners:
        res = results.get(r)
        parts.append(f"{r}={res.cls if res else '-':8}")
    parts += [f"[{r}] {results[r].message[:240]}" for r in runners if r in results and results[r].message]
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
