"""``edgeq bench``: latency, throughput and power of a bundle, on a remote device over TVM RPC or here."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgeq import backends
from edgeq.templates import contract, safebundle
from edgeq.bundle import read_tensor, read_tensors
from edgeq.choices import DEFAULT_REPEAT, DEFAULT_WARMUP, POWER_SOURCES
from edgeq.templates.contract import significant
from edgeq.errors import BundleError, UsageError
from edgeq.limits import LIMITS
from edgeq.rpc.power import Sampler
from edgeq.rpc.session import DAY_S, Remote, bounded, parse_addr
from edgeq.tvm_env import import_tvm

MAX_RUNS = LIMITS["benchmark_runs"].value  # --repeat and --warmup: beyond this a benchmark runs for days


@dataclasses.dataclass
class BenchArgs:
    bundle: Path
    rpc: str | None = None
    key: str | None = None
    repeat: int = DEFAULT_REPEAT
    warmup: int = DEFAULT_WARMUP
    power: str = "auto"
    timeout: float = 120.0
    session_timeout: float = 0.0
    power_mode: str | None = None  # --power-mode NAME|ID: nvpmodel's mode for the run, restored after it
    lock_clocks: bool = False  # --lock-clocks: jetson_clocks for the run, restored after it


def in_order_ms(times_s) -> list[float]:
    """Per-run latencies in ms, in the order they ran (4 significant digits)."""
    return [contract.significant(t * 1e3) for t in times_s]


def power_config(manifest: contract.Manifest) -> dict:
    """The bundle's device's rails (``device.power`` in the manifest; none for a device without rails)."""
    power = manifest.device.power
    return power.to_json() if power else {}


def energy(power: dict, stats: dict) -> dict:
    """Average power per rail and in total, the energy of one inference (total power x mean latency), and
    the power per rail over the window (``trace``: ``t_s``, and W per rail)."""
    rails = {r: round(mw / 1000, 4) for r, mw in power.get("average_mw", {}).items()}
    out = {"source": power.get("source", "none"), "samples": power.get("samples", 0), "window_s": power.get("window_s"),
           "average_w": rails}
    if rails:
        total = sum(rails.values())
        out.update(total_w=round(total, 4),
                   energy_per_inference_mj=significant(total * stats["mean_ms"] / stats["batch"]))
    trace = power.get("trace")
    if trace and trace.get("t_s"):
        out["trace"] = {"t_s": trace["t_s"], "w": {r: [None if mw is None else round(mw / 1000, 4) for mw in values]
                                                   for r, values in trace["mw"].items()}}
    return out


def _bundle(path: Path, workdir: str) -> tuple[Path, dict]:
    try:
        return safebundle.open_bundle(path, workdir)
    except safebundle.BundleRefused as err:
        raise BundleError(f"{path}: refused: {err}") from None


def _inputs(directory: Path, manifest: contract.Manifest) -> list[np.ndarray]:
    golden = read_tensors(directory, manifest.golden)
    return [golden["input:" + s.name] for s in manifest.inputs]


def _weights(directory: Path, manifest: contract.Manifest) -> list[np.ndarray]:
    return [read_tensor(directory / manifest.weights.file, t) for t in manifest.weights.tensors]


def bench(args: BenchArgs, note=lambda _: None) -> dict[str, Any]:
    bounded("--repeat", args.repeat, 1, MAX_RUNS)
    bounded("--warmup", args.warmup, 0, MAX_RUNS)
    bounded("--timeout", args.timeout, 1, DAY_S)
    bounded("--session-timeout", args.session_timeout, 0, DAY_S)
    if args.power not in POWER_SOURCES:
        raise UsageError(f"--power must be one of {', '.join(POWER_SOURCES)}")
    if (args.rpc is None) != (args.key is None):
        raise UsageError("give both --rpc HOST:PORT and --key KEY, or neither (measure here)")
    if args.rpc:
        parse_addr(args.rpc)
    tvm = import_tvm()
    from tvm.runtime.vm import VirtualMachine

    with tempfile.TemporaryDirectory(prefix="edgeq-bench-") as tmp:
        directory, manifest = _bundle(Path(args.bundle), tmp)
        if manifest.generate is not None:
            raise UsageError(f"{args.bundle} is a language model; edgeq bench times one inference of a tensor model. "
                             "Time its tokens with the bundle's run.py --prompt TEXT --json (decode tokens per second)")
        if manifest.device.kind not in backends.BACKENDS:
            raise BundleError(f"{args.bundle}: its device kind '{manifest.device.kind}' is none this edgeq knows "
                              f"({', '.join(backends.BACKENDS)}); bench it with the edgeq that built it")
        device_type = backends.get(manifest.device.kind).device_type  # the TVM runtime's name: "cpu", "cuda"
        config = power_config(manifest)
        if args.rpc:
            note(f"connecting to {args.rpc} for a '{args.key}' device")
            remote = Remote.open(args.rpc, args.key, args.timeout, args.session_timeout)
            sess = remote.session
            remote.call("upload the library", sess.upload, str(directory / manifest.library.file))
            lib = remote.call("load the library on the device", sess.load_module, manifest.library.file)
            dev = sess.device(device_type, 0)
            call = remote.call
            start = lambda: call("start power sampling",
                                 lambda: sess.get_function("edgeq.power.start")(args.power, json.dumps(config)))
            stop = lambda: json.loads(call("stop power sampling", lambda: sess.get_function("edgeq.power.stop")()))
            device = _remote_device(sess, call, config)
            where = f"{args.key} via {args.rpc}"
        else:
            lib = tvm.runtime.load_module(str(directory / manifest.library.file))
            dev = tvm.device(device_type, 0)
            call = lambda step, fn, *a, **kw: fn(*a, **kw)
            sampler = Sampler(args.power, config)
            start = lambda: sampler.start().source
            stop = sampler.stop
            device = _local_device(config)
            where = "this machine"
        with _settled(device, args.power_mode, args.lock_clocks) as settled:
            vm = call("create the VM", VirtualMachine, lib, dev)
            problem = contract.argument_count_problem(call("read the model's signature", vm._get_function_arity, "main"),
                                                      manifest)
            if problem:
                raise BundleError(f"{args.bundle}: {problem}")
            arrays = call("copy inputs and weights to the device",
                          lambda: [tvm.runtime.tensor(a, dev) for a in _inputs(directory, manifest) + _weights(directory, manifest)])
            note(f"warming up ({args.warmup}) and timing ({args.repeat}) on {where}")
            warmup_s = []
            if args.warmup:  # timed too, on the device, to show how the latency settles (TVM's timer adds one untimed first call)
                warm = call("prepare the warm-up timer", vm.time_evaluator, "main", dev, number=1, repeat=args.warmup)
                warmup_s = list(call("warm-up runs", warm, *arrays).results)
            call("synchronise", dev.sync)
            state = device.state()  # the mode and clocks the timed runs ran under
            timer = call("prepare the timer", vm.time_evaluator, "main", dev, number=1, repeat=args.repeat)
            source = start() if args.power != "none" else "none"
            try:
                result = call("timed runs", timer, *arrays)
            except Exception:
                if args.power != "none":
                    try:
                        stop()
                    except Exception:  # the device is gone: the timing error is the one to report
                        pass
                raise
            power = stop() if args.power != "none" else {"source": "none"}
        stats = contract.latency_statistics([t * 1e3 for t in result.results], manifest.batch)
    return {"bundle": str(args.bundle), "bundle_id": manifest.bundle_id, "device": manifest.device.profile,
            "where": where, "warmup": args.warmup, **stats,
            "power": energy(power, stats) | {"requested": args.power, "used": source},
            "device_state": state | {"set": {"power_mode": args.power_mode, "lock_clocks": args.lock_clocks,
                                             **(settled or {})}},
            "warmup_ms": in_order_ms(warmup_s), "samples_ms": in_order_ms(result.results)}


@contextlib.contextmanager
def _settled(device, mode: str | None, lock: bool):
    """``--power-mode`` and ``--lock-clocks`` for the runs inside, put back after them, after a failure too (whose
    error is then the one reported; a server also restores when its session ends)."""
    settled = device.settle(mode, lock)
    try:
        yield settled
    except BaseException:
        if settled is not None:
            with contextlib.suppress(Exception):
                device.restore()
        raise
    if settled is not None:
        device.restore()


class _Device:
    """The device's power mode and clocks: read (``state``), set for the run (``settle``) and put back
    (``restore``), here or through the server's ``edgeq.device.*`` functions."""

    def __init__(self, read, settle, restore):
        self._read, self._settle, self._restore = read, settle, restore

    def state(self) -> dict:
        return self._read()

    def settle(self, mode: str | None, lock: bool) -> dict | None:
        if not mode and not lock:
            return None
        return self._settle(mode or "", lock)

    def restore(self) -> None:
        self._restore()


def _local_device(config: dict) -> _Device:
    from edgeq.errors import DeviceError
    from edgeq.rpc.clocks import ClockError, Settings, read_state

    settings = Settings(config)

    def settle(mode, lock):
        try:
            return settings.apply(mode or None, lock)
        except ClockError as err:
            settings.restore()
            raise UsageError(str(err)) from None

    def restore():
        try:
            settings.restore()
        except ClockError as err:
            raise DeviceError(f"could not put the power mode and clocks back: {err}") from None

    return _Device(lambda: read_state(config), settle, restore)


def _remote_device(sess, call, config: dict) -> _Device:
    from edgeq.errors import RemoteError

    def function(name):
        try:
            return sess.get_function(name)
        except Exception:  # an edgeq rpc serve older than these functions
            return None

    def read():
        fn = function("edgeq.device.state")
        return json.loads(call("read the power mode and clocks", fn, json.dumps(config))) if fn else {
            "nvpmodel": None, "note": "the device's edgeq rpc serve does not report its mode and clocks"}

    def settle(mode, lock):
        fn = function("edgeq.device.settle")
        if fn is None:
            raise RemoteError("the device's edgeq rpc serve cannot set a power mode or lock clocks; update edgeq there")
        answer = json.loads(call("set the power mode and clocks", fn, mode, int(lock), json.dumps(config)))
        if "error" in answer:  # the device's one line (clocks.ClockError)
            raise UsageError(f"on the device: {answer['error']}")
        return answer

    def restore():
        fn = function("edgeq.device.restore")
        if fn is not None:
            call("restore the power mode and clocks", fn)

    return _Device(read, settle, restore)
