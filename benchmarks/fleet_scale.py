"""``edgeq flash`` at fleet scale: 32 real OpenSSH hosts on loopback, each with its own release root, a rollout
with waves and injected faults, measured in one run.

Every host first gets release 1 (a small bundle). Then release 2 (a ~50 MB bundle, so that uploads take a
while) is rolled out with ``--parallel 8 --canary 2 --batch 10 --max-failures 6``, while:

- 3 hosts' self-test fails after the switch (their python fails in ``current``): rolled back to release 1;
- 1 host's sshd is killed in the middle of its upload: failed, ``current`` untouched;
- 1 host completes the TCP handshake and never says a word: failed within the connect timeout;
- 1 host comes back with a changed host key: refused before any command.

It reports the wall time, the hosts per state, and checks that no host is left between releases (each
one's ``current`` is release 1 or 2 and is what the report says). The same rollout is then run again: it
must update nothing.

    python benchmarks/fleet_scale.py [--hosts 32] [--parallel 8] [--json]
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common import show

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import sshd  # noqa: E402 - the loopback sshd helper the fleet tests use

import make_models  # noqa: E402

from edgeq.cli.main import Environment, main as edgeq_main  # noqa: E402

FAILING_SELF_TEST, KILLED, SILENT, NEW_KEY = 3, 1, 1, 1


def cli(*argv) -> tuple[int, str, str]:
    import io

    out, err = io.StringIO(), io.StringIO()
    code = edgeq_main([str(a) for a in argv], Environment(stdout=out, stderr=err))
    return code, out.getvalue(), err.getvalue()


def package(model: Path, out: Path, release: int) -> tuple[Path, str]:
    code, stdout, stderr = cli("package", model, "--device", "host", "-o", out, "--name", "net", "--release", release,
                               "-q", "--json")
    if code:
        sys.exit(f"fleet_scale: packaging failed: {stderr.strip()}")
    result = json.loads(stdout)
    return Path(result["archive"]), result["bundle_id"]


def write_fleet(path: Path, hosts, key: Path, pythons: dict, silent_port: int | None) -> Path:
    (path.parent / "known_hosts").write_text("".join(h.known_hosts_line() + "\n" for h in hosts))
    lines = ['known_hosts = "known_hosts"', "connect_timeout = 5", "command_timeout = 300"]
    for h in hosts:
        lines += ["[[hosts]]", f'name = "{h.name}"', 'address = "127.0.0.1"', f"port = {h.port}",
                  f'user = "{getpass.getuser()}"', f'key = "{key}"', f'python = "{pythons.get(h.name, sys.executable)}"',
                  f'root = "{h.root}"', 'device = "host"']
    if silent_port is not None:
        lines += ["[[hosts]]", 'name = "silent"', 'address = "127.0.0.1"', f"port = {silent_port}",
                  f'user = "{getpass.getuser()}"', f'key = "{key}"', f'root = "{path.parent / "silent-root"}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def current(root: Path) -> str | None:
    link = root / "current"
    return os.readlink(link).split("/")[-1] if link.is_symlink() else None


def kill_during_upload(victim, stop: threading.Event) -> None:
    incoming = victim.root / ".edgeq" / "incoming"
    while not stop.is_set():
        parts = list(incoming.glob("*.part")) if incoming.exists() else []
        if parts and parts[0].stat().st_size > 0:
            victim.kill()
            return
        time.sleep(0.005)


def flash(archive: Path, fleet: Path, *extra) -> tuple[int, dict, float]:
    start = time.perf_counter()
    code, stdout, stderr = cli("flash", archive, "--fleet", fleet, "--json", *extra)
    seconds = time.perf_counter() - start
    if not stdout:
        sys.exit(f"fleet_scale: flash gave no report: {stderr.strip()}")
    return code, json.loads(stdout), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=32, help="hosts in all, the silent one included (at least 8)")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgeq-fleet-scale-") as tmp:
        tmp = Path(tmp)
        models = {p.stem: p for p in make_models.write_all(tmp / "models")}
        v1, id1 = package(models["mobilenet_cnn"], tmp / "r1", 1)
        v2, id2 = package(make_models.big_matmul(tmp / "big.onnx"), tmp / "r2", 2)
        bundle_mb = round(v2.stat().st_size / 1e6, 1)
        hosts, key = sshd.make_hosts(tmp / "ssh", args.hosts - SILENT)
        silent = socket.socket()
        try:
            silent.bind(("127.0.0.1", 0))
            silent.listen(64)  # completes TCP handshakes, never says a word
            fleet = write_fleet(tmp / "fleet.toml", hosts, key, {}, None)
            code, report, _ = flash(v1, fleet, "--parallel", str(args.parallel))
            if code:
                sys.exit(f"fleet_scale: the first rollout failed: {report['summary']}")

            # the faults: the first hosts after the two canaries, so that every wave meets some
            failing = hosts[2:2 + FAILING_SELF_TEST]
            victim = hosts[2 + FAILING_SELF_TEST]
            rekeyed = hosts[3 + FAILING_SELF_TEST]
            flaky = tmp / "flaky-python"
            flaky.write_text(f'#!/bin/sh\ncase "$PWD" in */current) echo "self-test FAILED: injected fault" >&2; '
                             f'exit 1;; esac\nexec {sys.executable} "$@"\n')
            flaky.chmod(0o755)
            fleet = write_fleet(tmp / "fleet.toml", hosts, key, {h.name: flaky for h in failing},
                                silent.getsockname()[1])
            rekeyed.new_host_key()
            stop = threading.Event()
            killer = threading.Thread(target=kill_during_upload, args=(victim, stop))
            killer.start()
            rollout = ("--parallel", str(args.parallel), "--canary", "2", "--batch", "10", "--max-failures", "6")
            try:
                code, report, seconds = flash(v2, fleet, *rollout)
            finally:
                stop.set()
                killer.join()
            states = Counter(h["state"] for h in report["hosts"])
            between = []
            for row in report["hosts"]:
                host = next((h for h in hosts if h.name == row["host"]), None)
                now = current(host.root) if host else None
                # a host the rollout could not reach reports no "after"; its current must still be a whole release
                if host is not None and (now not in (id1, id2) or (row["after"] is not None and now != row["after"])):
                    between.append(row["host"])
            failed = {row["host"]: row["error"] for row in report["hosts"] if row["state"] == "failed"}
            rerun_code, rerun, rerun_seconds = flash(v2, fleet, *rollout)
            rerun_states = Counter(h["state"] for h in rerun["hosts"])
        finally:
            silent.close()
            for h in hosts:
                h.kill()
    result = {
        "hosts": args.hosts, "parallel": args.parallel, "bundle_mb": bundle_mb,
        "rollout_s": round(seconds, 1), "states": dict(states), "waves": [len(w) for w in report["waves"]],
        "left_between_releases": between, "failed": failed,
        "rerun_s": round(rerun_seconds, 1), "rerun_states": dict(rerun_states),
        "rerun_updated": rerun_states.get("updated", 0),
    }
    healthy = args.hosts - FAILING_SELF_TEST - KILLED - SILENT - NEW_KEY
    result["as_expected"] = (states.get("updated", 0) == healthy and states.get("rolled-back", 0) == FAILING_SELF_TEST
                             and states.get("failed", 0) == KILLED + SILENT + NEW_KEY and not between
                             and result["rerun_updated"] == 0)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    show(f"edgeq flash: {args.hosts} loopback sshd hosts, --parallel {args.parallel} --canary 2 --batch 10, "
         f"a {result['bundle_mb']} MB bundle", [
             {"": "rollout", "wall s": result["rollout_s"], **{k: states.get(k, 0) for k in ("updated", "rolled-back", "failed", "skipped", "already")}},
             {"": "re-run", "wall s": result["rerun_s"], **{k: rerun_states.get(k, 0) for k in ("updated", "rolled-back", "failed", "skipped", "already")}},
         ])
    for host, error in failed.items():
        print(f"  failed {host}: {error}")
    print(f"left between releases: {between or 'none'}; as expected: {result['as_expected']}")


if __name__ == "__main__":
    main()
