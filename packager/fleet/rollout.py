"""A rollout: per host, stage -> self-test -> activate -> self-test -> prune, rolled back on failure
(``flash_host``); hosts canaries first, then in waves, ``--parallel`` at a time, stopping new hosts once
``--max-failures`` is passed (``flash``); the fleet's status and rollback."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgeq.errors import BundleError, UsageError
from edgeq.fleet.config import MAX_HOSTS, MAX_PARALLEL, Fleet, Host, load_fleet, parse_count
from edgeq.fleet.device import Device, HostFailure, plain
from edgeq.templates import contract, safebundle
from edgeq.templates.contract import HostState


@dataclasses.dataclass
class HostResult:
    host: str
    state: HostState = HostState.SKIPPED
    before: str | None = None
    after: str | None = None
    duration_s: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class FlashPlan:
    archive: Path
    manifest: contract.Manifest
    allow_downgrade: bool = False


def _q(*parts: str) -> str:
    return " ".join(shlex.quote(p) for p in parts)


def _device_paths(host: Host) -> dict[str, str]:
    tools = f"{host.root}/.edgeq"
    return {"tools": tools, "guard": f"{tools}/{contract.VERIFIER}", "contract": f"{tools}/{contract.CONTRACT}",
            "key": f"{tools}/trusted.pub", "incoming": f"{tools}/incoming"}


def _setup_tools(dev: Device, host: Host, fleet: Fleet) -> dict[str, str]:
    paths = _device_paths(host)
    dev.run(_q("mkdir", "-p", paths["incoming"], f"{host.root}/releases"), "prepare")
    dev.put(Path(contract.__file__), paths["contract"], "upload verifier")  # safebundle.py imports it
    dev.put(Path(safebundle.__file__), paths["guard"], "upload verifier")
    if fleet.public_key is not None:
        dev.put(fleet.public_key, paths["key"], "upload public key")
    return paths


def _answer(dev: Device, command: str, step: str) -> dict[str, Any]:
    """The JSON object a device command prints; anything else fails the host, not edgeq."""
    try:
        value = json.loads(dev.run(command, step))
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise HostFailure(f"{step}: the device did not answer with a JSON object")
    return value


def _status(dev: Device, host: Host, paths: dict[str, str]) -> dict[str, Any]:
    return _answer(dev, _q(host.python, paths["guard"], "status", "--root", host.root), "status")


def _self_test(dev: Device, host: Host, bundle_dir: str, step: str, fleet: Fleet, paths: dict[str, str]) -> None:
    env = f"EDGEQ_TRUSTED_KEY={shlex.quote(paths['key'])} " if fleet.public_key is not None else ""
    dev.run(f"cd {shlex.quote(bundle_dir)} && {env}{_q(host.python, 'run.py', '--self-test')}", step)


def flash_host(host: Host, fleet: Fleet, plan: FlashPlan, note: Callable[[str], None]) -> HostResult:
    result = HostResult(host.name)
    start = time.monotonic()
    dev = None
    switched = False
    bundle_id = plan.manifest.bundle_id
    try:
        want = plan.manifest.device.profile
        if host.device and host.device != want:
            raise HostFailure(f"preflight: host is a {host.device}, the bundle is for {want}")
        note(f"{host.name}: connecting to {host.address}:{host.port}")
        dev = Device(host, fleet)
        paths = _setup_tools(dev, host, fleet)
        before = _status(dev, host, paths)
        result.before = result.after = before["current"]
        if before["current"] == bundle_id:
            result.state = HostState.ALREADY
            note(f"{host.name}: already on {bundle_id}")
            return result
        arch = dev.run("uname -m", "preflight").strip()
        if arch != plan.manifest.device.arch:
            raise HostFailure(f"preflight: host is {arch}, the bundle is for {plan.manifest.device.arch}")
        # the bundle's runtime/ (edgeq-run) runs it where the device's python has no TVM
        probe = ("import os, json\ntry:\n    import tvm; v = tvm.__version__\nexcept ImportError:\n    v = None\n"
                 "s = os.statvfs(%r); print(json.dumps({'free': s.f_bavail * s.f_frsize, 'tvm': v}))" % host.root)
        facts = _answer(dev, _q(host.python, "-c", probe), "preflight (python, TVM or bundled runtime)")
        if facts["tvm"] is None and plan.manifest.runtime is None:
            raise HostFailure("preflight: the device's python has no TVM and the bundle carries no runtime "
                              "(packaged with --runtime none); package it with the runtime or install apache-tvm there")
        need = 3 * plan.archive.stat().st_size
        if facts["free"] < need:
            raise HostFailure(f"preflight: {facts['free'] >> 20} MB free under {host.root}, {need >> 20} MB needed")
        note(f"{host.name}: uploading {plan.archive.name}")
        remote = f"{paths['incoming']}/{bundle_id}.tar.gz"
        dev.put(plan.archive, remote, "upload")  # as remote.part, checked, renamed
        stage_cmd = [host.python, paths["guard"], "stage", remote, "--root", host.root]
        if fleet.public_key is not None:
            stage_cmd += ["--pub", paths["key"]]
        if plan.allow_downgrade:
            stage_cmd.append("--allow-downgrade")
        staged = _answer(dev, _q(*stage_cmd), "verify and unpack")
        note(f"{host.name}: verified and unpacked; health check")
        _self_test(dev, host, staged["path"], "health check (new release)", fleet, paths)
        dev.run(_q(host.python, paths["guard"], "activate", "--root", host.root, bundle_id), "switch")
        switched = True
        result.after = bundle_id
        _self_test(dev, host, f"{host.root}/current", "health check (through current)", fleet, paths)
        dev.run(_q(host.python, paths["guard"], "prune", "--root", host.root) + " && " + _q("rm", "-f", remote), "prune")
        result.state = HostState.UPDATED
        note(f"{host.name}: updated to {bundle_id}")
    except Exception as err:  # HostFailure, or anything unexpected: one host never takes the rollout down
        result.error = str(err) if isinstance(err, HostFailure) else plain(f"unexpected {type(err).__name__}: {err}")
        result.state = HostState.FAILED
        if switched and dev is not None:
            try:
                dev.run(_q(host.python, _device_paths(host)["guard"], "rollback", "--root", host.root), "rollback")
                result.state, result.after = HostState.ROLLED_BACK, result.before
            except HostFailure as rollback_err:
                result.error += f"; rollback failed too: {rollback_err}"
        note(f"{host.name}: {result.state}: {result.error}")
    finally:
        if dev is not None:
            dev.close()
        result.duration_s = round(time.monotonic() - start, 2)
    return result


# ---------------------------------------------------------------------------------------------------
# the rollout
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FlashArgs:
    bundle: Path
    fleet: Path
    canary: str | None = None
    batch: int | None = None
    max_failures: str | None = "0"
    parallel: int = 4
    dry_run: bool = False
    allow_downgrade: bool = False


def waves(hosts: tuple[Host, ...], canary: int, batch: int | None) -> list[list[Host]]:
    """Canary hosts first (tagged 'canary' before others), then batches of the rest."""
    ordered = sorted(hosts, key=lambda h: "canary" not in h.tags)
    first, rest = ordered[:canary], ordered[canary:]
    size = batch or len(rest) or 1
    return ([first] if first else []) + [rest[i : i + size] for i in range(0, len(rest), size)]


def check_args(args: FlashArgs) -> None:
    """Refuse out-of-range numbers before the fleet file, the bundle or any host is touched."""
    if args.batch is not None and not 1 <= args.batch <= MAX_HOSTS:
        raise UsageError(f"--batch must be from 1 to {MAX_HOSTS}, not {args.batch}")
    if not 1 <= args.parallel <= MAX_PARALLEL:
        raise UsageError(f"--parallel must be from 1 to {MAX_PARALLEL}, not {args.parallel}")
    parse_count(args.canary, 0, "--canary")
    parse_count(args.max_failures, 0, "--max-failures")


def flash(args: FlashArgs, note: Callable[[str], None] = lambda _: None) -> tuple[list[HostResult], list[list[str]]]:
    check_args(args)
    fleet = load_fleet(args.fleet)
    if Path(args.bundle).is_dir():
        raise UsageError("edgeq flash takes the bundle's .tar.gz archive, not its folder")
    try:
        key = safebundle.load_public_key(fleet.public_key) if fleet.public_key else None
    except safebundle.BundleRefused as err:
        raise UsageError(f"fleet file {args.fleet}: {err}") from None
    import tempfile

    with tempfile.TemporaryDirectory(prefix="edgeq-flash-") as tmp:
        try:
            _, manifest = safebundle.open_bundle(args.bundle, tmp, key)  # refuse a bad bundle before any host
        except safebundle.BundleRefused as err:
            raise BundleError(f"{args.bundle}: refused: {err}") from None
    total = len(fleet.hosts)
    plan_waves = waves(fleet.hosts, parse_count(args.canary, total, "--canary"), args.batch)
    names = [[h.name for h in w] for w in plan_waves]
    if args.dry_run:
        return [HostResult(h.name, state=HostState.SKIPPED, error="dry run") for h in fleet.hosts], names
    max_failures = parse_count(args.max_failures, total, "--max-failures")
    plan = FlashPlan(Path(args.bundle), manifest, args.allow_downgrade)
    results: dict[str, HostResult] = {}
    lock = threading.Lock()
    failures = 0

    def run_one(host: Host) -> None:
        nonlocal failures
        with lock:
            if failures > max_failures:
                results[host.name] = HostResult(host.name, HostState.SKIPPED, error="rollout stopped: too many failures")
                return
        res = flash_host(host, fleet, plan, note)
        with lock:
            results[host.name] = res
            if res.state in (HostState.FAILED, HostState.ROLLED_BACK):
                failures += 1

    for wave in plan_waves:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            list(pool.map(run_one, wave))
    return [results[h.name] for h in fleet.hosts], names


def fleet_status(fleet_path: Path) -> list[dict[str, Any]]:
    fleet = load_fleet(fleet_path)
    rows = []
    for host in fleet.hosts:
        row = {"host": host.name, "current": None, "release": None, "previous": None, "error": ""}
        try:
            dev = Device(host, fleet)
            try:
                paths = _setup_tools(dev, host, fleet)
                row.update({k: v for k, v in _status(dev, host, paths).items() if k in row})
            finally:
                dev.close()
        except HostFailure as err:
            row["error"] = str(err)
        rows.append(row)
    return rows


def fleet_rollback(fleet_path: Path, only: list[str] | None = None, note: Callable[[str], None] = lambda _: None) -> list[HostResult]:
    fleet = load_fleet(fleet_path)
    missing = sorted(set(only or ()) - {h.name for h in fleet.hosts})
    if missing:
        raise UsageError(f"fleet file {fleet_path} has no host {', '.join(map(repr, missing))}; its hosts: "
                         + plain(", ".join(h.name for h in fleet.hosts)))
    out = []
    for host in fleet.hosts:
        if only and host.name not in only:
            continue
        res, start = HostResult(host.name), time.monotonic()
        try:
            dev = Device(host, fleet)
            try:
                paths = _setup_tools(dev, host, fleet)
                res.before = _status(dev, host, paths)["current"]
                done = _answer(dev, _q(host.python, paths["guard"], "rollback", "--root", host.root), "rollback")
                res.after = done.get("current")
                _self_test(dev, host, f"{host.root}/current", "health check", fleet, paths)
                res.state = HostState.ROLLED_BACK
            finally:
                dev.close()
        except HostFailure as err:
            res.state, res.error = HostState.FAILED, str(err)
        res.duration_s = round(time.monotonic() - start, 2)
        note(f"{host.name}: {res.state} {res.error}".strip())
        out.append(res)
    return out
