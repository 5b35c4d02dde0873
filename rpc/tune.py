"""``edgeq tune``: search schedules on the device over TVM RPC with meta_schedule, and keep the best in a
records file that ``edgeq package --records`` applies.

meta_schedule works in this TVM wheel once apache-tvm-ffi is 0.1.14 (see pyproject.toml: with 0.1.15 its
TuneContext crashes in tvm::ffi::ToJSONGraph). Tasks are tuned one at a time and the records file is
rewritten after each, so an interrupted run loses at most one task's trials and a rerun resumes: tasks with
their share of trials already recorded are skipped.

A pool of devices is TVM's own: every device registered with the tracker under ``--key`` takes
measurements, one at a time each (the runner keeps as many in flight as there are devices; the tracker hands
each request to a free one), and candidates are built on ``--jobs`` host cores at once. A device that drops
out mid-search loses the measurement it had (recorded as failed, said in one line); the tracker stops handing
it out and the others go on. The summary counts the measurements each device made. The search is guided by
meta_schedule's XGBoost cost model (``--cost-model random``: blind guesses, as before), over a population sized
to the trials (``population``).

The module tuned is the one ``edgeq package`` compiles with the same options (``edgeq.package.front_end``:
``--const``, quantization with calibration, fp16, the backend's kernels). Records file: ``edgeq.records``
(JSON lines keyed by profile, TVM version, precision and workload).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeq.errors import RemoteError, UsageError
from edgeq.rpc.session import DAY_S, Remote, bounded, no_retry_warnings, parse_addr, with_deadline
from edgeq.records import Records, prepare
from edgeq.tvm_env import cheap_script_stacks, import_tvm

if TYPE_CHECKING:
    from edgeq.stage_records import FrontEndArgs

MAX_TRIALS = 100_000
BUILD_TIMEOUT_S = 300  # one candidate, built here (meta_schedule's 30 s fails every build on a busy 2-core host)
# The evolutionary search's population: candidates it samples, mutates and ranks by the cost model for each round
# of measurements. meta_schedule's default, 512, is sized for thousands of trials; a task given a few dozen spends
# most of its time there (a 16-trial task on 2 cores: 80 s with 512, 40 s with 64). Four candidates a trial, 64 to
# 512.
POPULATION_PER_TRIAL, POPULATION_MIN, POPULATION_MAX = 4, 64, 512


def population(trials_per_task: int) -> int:
    """The evolutionary search's population for a task given ``trials_per_task`` measurements."""
    return max(POPULATION_MIN, min(POPULATION_MAX, POPULATION_PER_TRIAL * trials_per_task))


def _unnamed_handlers_removed() -> None:
    """meta_schedule configures its loggers by handler name and fails ("'NoneType' object has no attribute
    'format'") on a handler without one on its logger, as a host application's (pytest's log capture) can
    leave there; such a handler is taken off that logger (messages still reach the root's)."""
    import logging

    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        if handler.get_name() is None:
            logger.removeHandler(handler)


def _console_off() -> None:
    """meta_schedule gives its logger a handler that prints every INFO line to stdout (where ``--json`` goes);
    edgeq says per task what happens, so that handler is taken off (its log files stay in the work folder)."""
    import logging

    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        if handler.get_name() == "tvm.s_tir.meta_schedule.console":
            logger.removeHandler(handler)


class DeviceUnreachable(RemoteError):
    """No session could be had (tracker or device gone, or hung): raised in the runner's worker process,
    where it ends the search instead of failing every remaining measurement one deadline at a time."""


_MEASURED_ON: list[str] = []  # in a runner worker process: the device its last session went to


def _create_session(config):
    """meta_schedule's session for one measurement, every step with the deadline (its own waits for a device
    forever); runs in the runner's worker process, and notes which device the tracker handed out."""
    import logging

    from tvm import rpc
    from tvm.rpc import client

    if not getattr(client.connect, "edgeq_notes_device", False):  # the tracker's answer names the device; keep it
        connect = client.connect

        def noting(url, port, *args, **kwargs):
            _MEASURED_ON[:] = [f"{url}:{port}"]
            return connect(url, port, *args, **kwargs)

        noting.edgeq_notes_device = True
        client.connect = noting
    _MEASURED_ON.clear()

    logging.getLogger("RPCServer").addFilter(no_retry_warnings)  # the deadline says it in one line
    seconds = config.session_timeout_sec
    try:
        tracker = with_deadline(f"connect to tracker {config.tracker_host}:{config.tracker_port}", seconds,
                                rpc.connect_tracker, config.tracker_host, config.tracker_port)
        return with_deadline(f"request a '{config.tracker_key}' device from the tracker", seconds, tracker.request,
                             config.tracker_key, priority=config.session_priority, session_timeout=seconds)
    except RemoteError as err:  # named with the device the tracker handed out, where it got that far
        raise DeviceUnreachable(f"[{_MEASURED_ON[0]}] {err}" if _MEASURED_ON else str(err)) from None


# The measurement's other remote steps (meta_schedule's defaults have no deadline: a device that stops
# answering mid-measurement would hold the search forever). ``seconds`` comes first: functools.partial.

def _upload_module(seconds: float, session, local_path: str, remote_path: str):
    with_deadline("upload a candidate to the device", seconds, session.upload, local_path, remote_path)
    return with_deadline("load a candidate on the device", seconds, session.load_module, remote_path)


def _alloc_argument(seconds: float, session, device, args_info, alloc_repeat: int):
    from tvm.s_tir.meta_schedule.runner.rpc_runner import default_alloc_argument

    return with_deadline("allocate a candidate's arguments on the device", seconds, default_alloc_argument, session,
                         device, args_info, alloc_repeat)


def _run_evaluator(seconds: float, session, rt_mod, device, evaluator_config, repeated_args):
    from tvm.s_tir.meta_schedule.runner.rpc_runner import default_run_evaluator

    return with_deadline("time a candidate on the device", seconds, default_run_evaluator, session, rt_mod, device,
                         evaluator_config, repeated_args)


def _cleanup(seconds: float, session, remote_path) -> None:
    from tvm.s_tir.meta_schedule.runner.rpc_runner import default_cleanup

    try:  # runs in a finally: never hides the measurement's own error, never waits past the deadline
        with_deadline("remove a candidate from the device", seconds, default_cleanup, session, remote_path)
    except RemoteError:
        pass


def _unreachable(error: BaseException | None) -> str | None:
    """The one-line reason when a measurement's worker could not get a session, else None. Exceptions come
    back from the worker process as their type around the worker's traceback: its last line is the message."""
    if not isinstance(error, DeviceUnreachable):
        return None
    lines = [line for line in str(error).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    _, sep, message = last.partition(f"{DeviceUnreachable.__name__}: ")
    return (message if sep else last).strip() or "no session"


MEASUREMENT_STEPS = 8  # connect, request, upload, load, allocate, run, clean up, and one for the worker itself


def _measure(*args):
    """meta_schedule's RPC measurement in a worker process: (costs, the device that measured), or the error with
    the device named where one was reached."""
    from tvm.s_tir.meta_schedule.runner.rpc_runner import _worker_func

    try:
        return _worker_func(*args), (_MEASURED_ON[0] if _MEASURED_ON else "")
    except DeviceUnreachable:
        raise
    except TimeoutError:
        raise
    except Exception as err:  # noqa: BLE001 - what the measurement raised, with where
        where = _MEASURED_ON[0] if _MEASURED_ON else ""
        raise RuntimeError(f"[{where}] {(str(err).strip().splitlines() or [type(err).__name__])[-1]}") from None


def pool_size(host: str, port: int, key: str, seconds: float) -> int:
    """How many devices are registered with the tracker under ``key`` (free or busy)."""
    from tvm import rpc

    tracker = with_deadline(f"connect to tracker {host}:{port}", seconds, rpc.connect_tracker, host, port)
    summary = with_deadline("ask the tracker for its devices", seconds, tracker.summary)
    servers = [s for s in summary.get("server_info", []) if str(s.get("key", "")).split(":")[-1] == key]
    queue = summary.get("queue_info", {}).get(key, {})
    return max(len(servers), int(queue.get("free", 0)), 1)


def device_states(rpc: str, key: str, seconds: float, devices: int) -> list[dict]:
    """The power mode and clocks of each device under ``key`` as the search begins (``edgeq.rpc.clocks``): a session
    on each, held together so that the tracker hands out every device once; a device whose server is older than
    ``edgeq.device.state`` gives {"nvpmodel": None, "note": ...}."""
    held, states = [], []
    try:
        for _ in range(devices):
            held.append(Remote.open(rpc, key, seconds))
        for remote in held:
            try:
                fn = remote.session.get_function("edgeq.device.state")
            except Exception:  # an older edgeq rpc serve
                states.append({"nvpmodel": None, "note": "the device's edgeq rpc serve does not report its mode and clocks"})
                continue
            states.append(json.loads(remote.call("read the power mode and clocks", fn, "{}")))
    finally:
        held.clear()  # the sessions end with their last reference
    return states


def _runner(host: str, port: int, key: str, seconds: float, devices: int = 1, note=lambda _: None):
    """meta_schedule's RPC measurement (its worker function in ``devices`` worker processes, one measurement in
    flight per device) with a deadline on each remote step, the whole measurement bounded too (the worker is
    killed past ``MEASUREMENT_STEPS`` deadlines), and a search that cannot get a session at all ending: ``failure``
    then says why. Returns (runner, failure, measured: {device: measurements})."""
    import functools

    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner import PyRunner, PyRunnerFuture, RunnerResult
    from tvm.support.popen_pool import PopenPoolExecutor

    rpc_config = ms.runner.RPCConfig(tracker_host=host, tracker_port=port, tracker_key=key,
                                     session_timeout_sec=max(1, int(seconds)))
    evaluator_config = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False)
    steps = (_create_session, functools.partial(_upload_module, seconds), functools.partial(_alloc_argument, seconds),
             functools.partial(_run_evaluator, seconds), functools.partial(_cleanup, seconds))
    pool = PopenPoolExecutor(max_workers=max(1, devices), timeout=MEASUREMENT_STEPS * seconds,
                             initializer=cheap_script_stacks)
    failure: list[str] = []
    measured: dict[str, int] = {}
    dropped: set[str] = set()

    @derived_object
    class Future(PyRunnerFuture):
        def __init__(self, future):
            super().__init__()
            self.future = future

        def done(self) -> bool:
            return self.future.done()

        def result(self):
            try:
                costs, device = self.future.result()
                measured[device] = measured.get(device, 0) + 1
                return RunnerResult(costs, None)
            except TimeoutError:
                return RunnerResult(None, f"measurement killed after {MEASUREMENT_STEPS * seconds:g} s")
            except Exception as err:  # noqa: BLE001 - a failed measurement is a result, unless no device answered
                why = _unreachable(err)
                text = why if why is not None else (str(err).strip().splitlines() or [type(err).__name__])[-1]
                device, reason = _tagged(text)
                if device and device not in dropped and (why is not None or _lost(reason)):
                    dropped.add(device)
                    note(f"device {device} dropped out ({reason[:120]})" +
                         ("; the others go on" if len(dropped) < devices else ""))
                if why is not None and (not device or len(dropped) >= devices):
                    failure.append(why)
                    raise RemoteError(why) from None  # ends tune_tasks; tune() reports ``failure``
                return RunnerResult(None, f"measurement failed: {text}")

    @derived_object
    class Runner(PyRunner):
        def run(self, runner_inputs):
            if failure:
                raise RemoteError(failure[0])
            return [Future(pool.submit(_measure, *steps, rpc_config, evaluator_config, 1,
                                       str(inp.artifact_path), str(inp.device_type),
                                       tuple(arg.as_json() for arg in inp.args_info)))
                    for inp in runner_inputs]

    return Runner(), failure, measured


def _tagged(text: str) -> tuple[str, str]:
    """("host:port", what follows) of a worker's message that ``_measure``/``_create_session`` tagged with the
    device ("... [host:port] ..."; the worker's exception type may come first), else ("", text)."""
    start = text.find("[")
    end = text.find("]", start + 1)
    if start < 0 or end < 0:
        return "", text
    return text[start + 1:end], text[end + 1:].strip()


def _lost(text: str) -> bool:
    """A measurement error that says the device went away (not that the candidate was bad)."""
    return any(s in text.lower() for s in ("connection", "broken pipe", "socket", "eof", "reset by peer", "timed out",
                                            "deadline", "unreachable"))


def _own_ms(workload, target, backend, builder, runner) -> float | None:
    """ms of ``workload``'s function as ``edgeq package`` schedules it without records (``Backend.own_schedule``),
    built and measured on the pool like a candidate; None where the backend cannot say or the measurement
    failed (then records are used as they are)."""
    from tvm.s_tir import meta_schedule as ms

    tvm = import_tvm()
    tgt = tvm.target.Target(target)
    with tgt:
        scheduled = backend.own_schedule(workload, tgt)
    if scheduled is None:
        return None
    built = builder.build([ms.builder.BuilderInput(scheduled, tgt)])[0]
    if built.error_msg:
        return None
    func = next(f for f in workload.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    result = runner.run([ms.runner.RunnerInput(built.artifact_path, backend.device_type,
                                               ms.arg_info.ArgInfo.from_prim_func(func))])[0].result()  # (it waits)
    if result.error_msg or not result.run_secs:
        return None
    costs = [float(getattr(c, "value", c)) for c in result.run_secs]
    return 1e3 * sum(costs) / len(costs)


def moves_data_only(workload) -> bool:
    """A task's function only copies values (transpose, reshape, layout change): every store writes a value
    loaded as it is. Its schedule search has nothing to win (measured: a 16x16 transpose, edgeq's own 0.0004 ms,
    the best of 5 trials 0.0066 ms), so ``tune`` spends its trials on the tasks that compute."""
    import tvm_ffi

    tvm = import_tvm()
    func = next(f for f in workload.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    stores, copies = [0], [0]

    def visit(node):
        stores[0] += 1
        copies[0] += isinstance(node.value, tvm.ir.expr.TensorLoad)  # (tirx.BufferLoad makes one)
        return node

    tvm_ffi.structural_map(func, [(tvm.tirx.BufferStore, visit)])
    return stores[0] > 0 and stores[0] == copies[0]


@dataclasses.dataclass(frozen=True)
class TuneArgs:
    front: FrontEndArgs  # the module edgeq package builds with the same options (edgeq.package.front_end)
    rpc: str
    key: str
    trials: int = 64
    records: Path = Path("tuning.json")
    timeout: float = 120.0
    jobs: int | None = None  # candidates built at once (default: the host's cores)
    cost_model: str = "xgb"  # meta_schedule's XGBoost model, or "random"


COST_MODELS = ("xgb", "random")


def tune(args: TuneArgs, note=lambda _: None, tick=lambda *_: None, progress=None) -> dict[str, Any]:
    from edgeq.package import front_end
    from edgeq.targets import resolve

    bounded("--trials", args.trials, 1, MAX_TRIALS)
    bounded("--timeout", args.timeout, 1, DAY_S)
    jobs = args.jobs if args.jobs is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                     else os.cpu_count() or 1)
    bounded("--jobs", jobs, 1, 1024)
    if args.cost_model not in COST_MODELS:
        raise UsageError(f"unknown --cost-model '{args.cost_model}'; choose one of: {', '.join(COST_MODELS)}")
    if args.cost_model == "xgb":
        try:
            import xgboost  # noqa: F401 - meta_schedule's model imports it when the search starts
        except ImportError:
            raise UsageError("--cost-model xgb needs xgboost (pip install xgboost-cpu), or give --cost-model random") from None
    records_path = Path(args.records)
    if records_path.is_dir() or (records_path.exists() and not records_path.is_file()):
        raise UsageError(f"--records {records_path} is not a file; give a file such as {records_path / 'tuning.json'}")
    if not records_path.parent.is_dir():
        raise UsageError(f"--records {records_path}: folder {records_path.parent} does not exist; create it first")
    host, port = parse_addr(args.rpc)
    resolve(args.front.device)  # an unknown device: one line before the tracker is asked
    Remote.open(args.rpc, args.key, args.timeout)  # a dead tracker or an absent device: one line, within --timeout
    tvm = import_tvm()
    from tvm.s_tir import meta_schedule as ms
    from tvm.support import cc

    # the functions `edgeq package` compiles with the same options: its front end (quantization, fp16, the
    # backend's kernels), not a graph of tune's own
    built = front_end(args.front, progress)
    profile, toolchain, target, backend = built.profile, built.toolchain, built.lowered.target, built.backend
    mod = prepare(built.lowered.mod, target)
    every = ms.relax_integration.extract_tasks(mod, target)
    extracted = [task for task in every if not moves_data_only(task.dispatched[0])]
    for task in every:
        if task not in extracted:  # a transpose, reshape or layout change: nothing a schedule search can win
            note(f"{task.task_name}: moves data only, not tuned (edgeq's own schedule)")
    if not extracted:
        raise UsageError(f"{Path(args.front.model).name} has no function that computes (only data movement): "
                         "nothing to tune; package it without --records")
    records = Records(args.records, profile, precision=built.precision)
    per_task = max(1, args.trials // len(extracted))
    devices = pool_size(host, port, args.key, args.timeout)
    note(f"{devices} device(s) under '{args.key}': {devices} measurement(s) in flight; candidates built {jobs} at a time; "
         f"cost model {args.cost_model}")
    states = device_states(args.rpc, args.key, args.timeout, devices)  # the modes and clocks it measured under
    runner, unreachable, measured = _runner(host, port, args.key, args.timeout, devices, note)

    rows = []
    with tempfile.TemporaryDirectory(prefix="edgeq-tune-") as work:

        def export(rt_mod) -> str:  # inside the work folder: removed with it
            path = os.path.join(tempfile.mkdtemp(prefix="candidate-", dir=work), "candidate.so")
            rt_mod.export_library(path, fcompile=cc.cross_compiler(toolchain.cxx))
            return path

        builder = ms.builder.LocalBuilder(f_export=export, max_workers=jobs, timeout_sec=BUILD_TIMEOUT_S,
                                          initializer=cheap_script_stacks)
        _unnamed_handlers_removed()
        with contextlib.redirect_stdout(io.StringIO()):  # its console handler binds to the stdout of this moment
            strategy = ms.search_strategy.EvolutionarySearch(population_size=population(per_task))
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(extracted, work, strategy=strategy)
        _console_off()
        def gone(task_name: str, why: str) -> RemoteError:
            """The pool went away: what was measured so far is kept, and the search ends in one line."""
            records.save()
            return RemoteError(f"tuning {task_name}: {why}; measurements so far are in {records_path} (rerun to resume)")

        for i, (task, ctx, weight) in enumerate(zip(extracted, contexts, weights), 1):
            workload = task.dispatched[0]
            own_ms = records.baseline(workload)
            changed = False
            if own_ms is None:  # what a record must beat to be used (edgeq.records.Records.faster), measured once
                try:
                    own_ms = _own_ms(workload, target, backend, builder, runner)
                except Exception:  # the runner's error comes back through TVM's FFI as a RuntimeError
                    if unreachable:
                        raise gone(task.task_name, unreachable[0]) from None
                    raise
                if own_ms is not None:
                    records.set_baseline(workload, own_ms)
                    changed = True
            done = records.count(workload)
            if done >= per_task:
                note(f"task {i}/{len(extracted)} {task.task_name}: {done} trials recorded, skipped (resume)")
            else:
                changed = True
                note(f"task {i}/{len(extracted)} {task.task_name}: tuning {per_task - done} trials on '{args.key}'")
                try:  # still there? (each measurement has the deadline too)
                    Remote.open(args.rpc, args.key, args.timeout)
                except RemoteError as err:
                    raise gone(task.task_name, str(err)) from None
                try:
                    ms.tune_tasks(tasks=[ctx], task_weights=[weight], work_dir=work, max_trials_global=per_task - done,
                                  num_trials_per_iter=min(max(8, 2 * devices), per_task - done), builder=builder,
                                  runner=runner, database=records.database, cost_model=args.cost_model)
                except Exception as err:  # meta_schedule reports failed measurements itself; this is the search
                    if unreachable:  # what was measured before the device went away is kept
                        raise gone(task.task_name, unreachable[0]) from None
                    raise RemoteError(f"tuning {task.task_name}: {' '.join(str(err).split())[:300]}") from None
            if changed:
                records.save()
            best = records.database.get_top_k(records.database.commit_workload(workload), 1)
            best_ms = float(getattr(best[0].run_secs[0], 'value', best[0].run_secs[0])) * 1e3 if best and best[0].run_secs else None
            used = best_ms is not None and (own_ms is None or best_ms < own_ms)
            rows.append({"task": task.task_name, "trials_recorded": records.count(workload),
                         "best_ms": best_ms, "own_ms": own_ms, "tuned_used": used})
            tick("tasks", i, len(extracted))
            own = "" if own_ms is None else f" (edgeq's own {own_ms:.4f} ms: {'tuned used' if used else 'own kept'})"
            note(f"task {i}/{len(extracted)} {task.task_name}: best {best_ms:.4f} ms{own}" if best_ms else
                 f"task {i}/{len(extracted)} {task.task_name}: no successful measurement{own}")
    return {"model": str(args.front.model), "device": profile.name, "precision": built.precision,
            "records": str(args.records), "tasks": rows, "tvm_version": tvm.__version__, "cost_model": args.cost_model,
            "population": population(per_task),
            "jobs": jobs, "devices": {"registered": devices, "measurements": dict(sorted(measured.items())),
                                      "states": states},
            "not_tuned": [task.task_name for task in every if task not in extracted]}
