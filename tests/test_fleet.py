"""edgeq flash against real OpenSSH servers on loopback: one sshd per device, each with its own release root.
The CLI runs in-process; every device command goes over SSH."""

import getpass
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import make_models
import pytest

from conftest import run_cli
from sshd import SSHD, make_hosts

pytestmark = pytest.mark.skipif(not Path(SSHD).exists(), reason="needs openssh-server (scripts/setup.sh installs it)")


def write_fleet(path: Path, hosts, key: Path, extra_hosts: str = "", overrides: dict | None = None, public_key=None):
    overrides = overrides or {}
    known = path.parent / "known_hosts"
    known.write_text("".join(h.known_hosts_line() + "\n" for h in hosts))
    lines = ['known_hosts = "known_hosts"', "connect_timeout = 3", "command_timeout = 120"]
    if public_key:
        lines.append(f'public_key = "{public_key}"')
    for h in hosts:
        o = overrides.get(h.name, {})
        lines += ["[[hosts]]", f'name = "{h.name}"', 'address = "127.0.0.1"', f"port = {h.port}",
                  f'user = "{getpass.getuser()}"', f'key = "{key}"', f'python = "{o.get("python", sys.executable)}"',
                  f'root = "{h.root}"', 'device = "host"', f'tags = {json.dumps(o.get("tags", []))}']
    path.write_text("\n".join(lines) + "\n" + extra_hosts)
    return path


@pytest.fixture(scope="module")
def bundles(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("fleet-bundles")
    keys = out / "keys"
    assert run_cli("keygen", "--out", keys).code == 0

    def build(model, name, release):
        res = run_cli("package", model, "--device", "host", "-o", out / f"r{release}", "--name", name, "-q", "--json",
                      "--sign-key", keys / "edgeq_signing.key", "--release", str(release))
        assert res.code == 0, res.stderr
        return Path(json.loads(res.stdout)["archive"]), json.loads(res.stdout)["bundle_id"]

    return {"v1": build(models["mobilenet_cnn"], "net", 1), "v2": build(models["resnet_cnn"], "net", 2),
            "pub": keys / "edgeq_signing.pub"}


@pytest.fixture
def fleet(tmp_path):
    hosts, key = make_hosts(tmp_path / "ssh", 3)
    yield hosts, key, tmp_path
    for h in hosts:
        h.kill()


def flash(archive, fleet_file, *extra):
    res = run_cli("flash", archive, "--fleet", fleet_file, "--json", *extra)
    return res, json.loads(res.stdout) if res.stdout else None


def by_host(report):
    return {h["host"]: h for h in report["hosts"]}


def current(host) -> str | None:
    link = host.root / "current"
    return os.readlink(link).split("/")[-1] if link.is_symlink() else None


def test_all_hosts_updated_then_rerun_is_a_noop_and_rollback_returns(fleet, bundles):
    hosts, key, tmp = fleet
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key, public_key=bundles["pub"])
    (v1, id1), (v2, id2) = bundles["v1"], bundles["v2"]
    res, report = flash(v1, fleet_file, "--parallel", "3")
    assert res.code == 0, res.stderr
    assert {h["state"] for h in report["hosts"]} == {"updated"} and all(current(h) == id1 for h in hosts)
    res, report = flash(v1, fleet_file)
    assert res.code == 0 and {h["state"] for h in report["hosts"]} == {"already"}
    res, report = flash(v2, fleet_file, "--canary", "1", "--batch", "1", "--parallel", "2")
    assert res.code == 0 and report["summary"]["updated"] == 3 and len(report["waves"]) == 3
    assert all(h["before"] == id1 and h["after"] == id2 for h in report["hosts"])
    status = json.loads(run_cli("fleet", "status", "--fleet", fleet_file, "--json").stdout)
    assert [(s["current"], s["previous"], s["release"]) for s in status] == [(id2, id1, 2)] * 3
    back = run_cli("rollback", "--fleet", fleet_file, "--host", "dev0", "--json")
    assert back.code == 0, back.stderr
    assert current(hosts[0]) == id1 and current(hosts[1]) == id2
    old, _ = flash(v1, fleet_file, "--json")
    assert old.code == 1  # dev1 and dev2 refuse the older release
    assert "older than the installed release 2" in by_host(json.loads(old.stdout))["dev1"]["error"]


def test_failed_health_check_through_current_is_rolled_back(fleet, bundles):
    hosts, key, tmp = fleet
    wrapper = tmp / "flaky-python"
    wrapper.write_text(f'#!/bin/sh\ncase "$PWD" in */current) echo "self-test FAILED: NPU fault" >&2; exit 1;; esac\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key)
    (v1, id1), (v2, id2) = bundles["v1"], bundles["v2"]
    assert flash(v1, fleet_file)[0].code == 0
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key, overrides={"dev1": {"python": wrapper}})
    res, report = flash(v2, fleet_file, "--max-failures", "1")
    assert res.code == 1
    states = by_host(report)
    assert states["dev1"]["state"] == "rolled-back" and "NPU fault" in states["dev1"]["error"]
    assert states["dev1"]["after"] == id1 and current(hosts[1]) == id1
    assert states["dev0"]["state"] == states["dev2"]["state"] == "updated" and current(hosts[0]) == id2


def test_device_python_without_tvm_health_checks_with_edgeq_run(fleet, bundles):
    """A device whose Python has no numpy or TVM (-S: no site-packages): the health checks run the bundle's
    native loader (run.py hands over to runtime/edgeq-run), and the rollout succeeds."""
    hosts, key, tmp = fleet
    bare = tmp / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S -E "$@"\n')
    bare.chmod(0o755)
    fleet_file = write_fleet(tmp / "fleet.toml", hosts[:1], key, overrides={"dev0": {"python": bare}})
    res, report = flash(bundles["v1"][0], fleet_file)
    assert res.code == 0, res.stderr
    assert by_host(report)["dev0"]["state"] == "updated" and current(hosts[0]) == bundles["v1"][1]


def test_failures_beyond_the_threshold_stop_new_hosts(fleet, bundles):
    hosts, key, tmp = fleet
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key,
                             overrides={"dev2": {"python": "/nonexistent/python3", "tags": ["canary"]}})
    res, report = flash(bundles["v1"][0], fleet_file, "--canary", "1", "--max-failures", "0", "--parallel", "1")
    assert res.code == 1
    states = by_host(report)
    assert states["dev2"]["state"] == "failed" and report["waves"][0] == ["dev2"]
    assert states["dev0"]["state"] == states["dev1"]["state"] == "skipped"
    assert current(hosts[0]) is None and not (hosts[0].root / ".edgeq").exists()


def test_connection_dropped_mid_upload(fleet, bundles):
    hosts, key, tmp = fleet
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key)
    assert flash(bundles["v1"][0], fleet_file)[0].code == 0
    res = run_cli("package", make_models.big_matmul(tmp / "big.onnx"), "--device", "host", "-o", tmp / "big", "--name", "net",
                  "--release", "5", "-q", "--json")
    assert res.code == 0, res.stderr
    big = Path(json.loads(res.stdout)["archive"])
    assert big.stat().st_size > 40 << 20
    victim = hosts[1]
    incoming = victim.root / ".edgeq" / "incoming"

    def kill_during_upload():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            parts = list(incoming.glob("*.part")) if incoming.exists() else []
            if parts and parts[0].stat().st_size > 0:
                victim.kill()
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_during_upload)
    killer.start()
    res, report = flash(big, fleet_file, "--max-failures", "1", "--parallel", "3")
    killer.join()
    assert report is not None, res.stderr
    states = by_host(report)
    assert states["dev1"]["state"] == "failed" and "upload" in states["dev1"]["error"], states["dev1"]
    assert current(victim) == bundles["v1"][1]  # untouched
    assert states["dev0"]["state"] == states["dev2"]["state"] == "updated"


def test_changed_host_key_is_refused_before_any_command(fleet, bundles):
    hosts, key, tmp = fleet
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key)
    hosts[2].new_host_key()
    res, report = flash(bundles["v1"][0], fleet_file, "--max-failures", "1")
    states = by_host(report)
    assert states["dev2"]["state"] == "failed" and "host key changed" in states["dev2"]["error"]
    assert list(hosts[2].root.iterdir()) == []  # nothing ran there
    assert states["dev0"]["state"] == "updated"
    unknown = write_fleet(tmp / "fleet.toml", hosts[:2], key)  # known_hosts without dev2 at all
    text = unknown.read_text().replace('known_hosts = "known_hosts"', 'known_hosts = "known_hosts"')
    (tmp / "known_hosts").write_text(hosts[0].known_hosts_line() + "\n")
    unknown.write_text(text)
    res, report = flash(bundles["v1"][0], unknown, "--max-failures", "2")
    assert "unknown host key" in by_host(report)["dev1"]["error"]


def test_unreachable_host_times_out_within_the_bound(fleet, bundles):
    hosts, key, tmp = fleet
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # completes TCP handshakes, never says a word
    port = silent.getsockname()[1]
    extra = (f'[[hosts]]\nname = "silent"\naddress = "127.0.0.1"\nport = {port}\nuser = "{getpass.getuser()}"\n'
             f'key = "{key}"\nroot = "{tmp / "silent-root"}"\n')
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key, extra_hosts=extra)
    try:
        res, report = flash(bundles["v1"][0], fleet_file, "--max-failures", "1", "--parallel", "4")
    finally:
        silent.close()
    states = by_host(report)
    assert states["silent"]["state"] == "failed" and states["silent"]["duration_s"] < 15
    assert "connect" in states["silent"]["error"]
    assert all(states[h.name]["state"] == "updated" for h in hosts)


def test_fleet_file_and_dry_run(fleet, bundles):
    hosts, key, tmp = fleet
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key)
    res, report = flash(bundles["v1"][0], fleet_file, "--dry-run", "--canary", "34%", "--batch", "1")
    assert res.code == 0 and report["waves"] == [["dev0", "dev1"], ["dev2"]]
    assert all(current(h) is None for h in hosts)
    (tmp / "bad.toml").write_text("[[hosts]]\nname = 1\n")
    bad = run_cli("flash", bundles["v1"][0], "--fleet", tmp / "bad.toml")
    assert bad.code == 2 and "needs 'name' and 'address'" in bad.stderr


def test_fleet_with_a_key_refuses_unsigned_bundles_before_any_host(fleet, bundles, models):
    hosts, key, tmp = fleet
    res = run_cli("package", models["mobilenet_cnn"], "--device", "host", "-o", tmp / "unsigned", "-q", "--json")
    unsigned = Path(json.loads(res.stdout)["archive"])
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key, public_key=bundles["pub"])
    res = run_cli("flash", unsigned, "--fleet", fleet_file)
    assert res.code == 7 and "not signed" in res.stderr
    assert all(list(h.root.iterdir()) == [] for h in hosts)


# ---- hosts without SFTP (minimal images, dropbear without sftp-server) ---------------------------------


@pytest.fixture
def no_sftp(tmp_path):
    hosts, key = make_hosts(tmp_path / "ssh", 2, sftp=False)
    yield hosts, key, tmp_path
    for h in hosts:
        h.kill()


def test_hosts_without_sftp_get_files_over_ssh_exec(no_sftp, bundles):
    """No 'Subsystem sftp' in sshd_config: the verifier, the public key and the archive are streamed through
    'cat' on an exec channel, checked (SHA-256) and renamed into place; flash and status work."""
    from edgeq.templates import safebundle

    hosts, key, tmp = no_sftp
    assert all("Subsystem" not in (h.dir / "sshd_config").read_text() for h in hosts)
    fleet_file = write_fleet(tmp / "fleet.toml", hosts, key, public_key=bundles["pub"])
    v1, id1 = bundles["v1"]
    res, report = flash(v1, fleet_file, "--parallel", "2")
    assert res.code == 0, res.stderr
    assert {h["state"] for h in report["hosts"]} == {"updated"} and all(current(h) == id1 for h in hosts)
    status = json.loads(run_cli("fleet", "status", "--fleet", fleet_file, "--json").stdout)  # uploads again
    assert [(s["current"], s["error"]) for s in status] == [(id1, "")] * 2
    for h in hosts:
        assert (h.root / ".edgeq" / "safebundle.py").read_bytes() == Path(safebundle.__file__).read_bytes()
        assert (h.root / ".edgeq" / "trusted.pub").read_bytes() == bundles["pub"].read_bytes()
        assert list(h.root.rglob("*.part")) == []


@pytest.mark.parametrize("instead_of_cat, words", [
    ('echo "sh: cat: not found" >&2; exit 127', ["the host has no SFTP subsystem", "(sh: cat: not found)",
                                                 "'Subsystem sftp internal-sftp'"]),
    ('exec /bin/sh -c "head -c 100 ${SSH_ORIGINAL_COMMAND#cat}"', ["(100 bytes, SHA-256", "is not the file sent",
                                                                   "retry"]),
])
def test_host_without_sftp_where_copying_fails_says_so_in_one_line(tmp_path, bundles, instead_of_cat, words):
    """Without SFTP and with 'cat' refused (a restricted account), the host fails with one line saying what to
    enable; a copy cut short is refused by its SHA-256 and never renamed into place."""
    shell = tmp_path / "restricted-shell"
    shell.write_text(f'#!/bin/sh\ncase "$SSH_ORIGINAL_COMMAND" in "cat > "*) {instead_of_cat};; esac\n'
                     'exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"\n')
    shell.chmod(0o755)
    hosts, key = make_hosts(tmp_path / "ssh", 1, sftp=False, extra_config=f"ForceCommand {shell}")
    try:
        fleet_file = write_fleet(tmp_path / "fleet.toml", hosts, key)
        res, report = flash(bundles["v1"][0], fleet_file)
        assert res.code == 1 and "Traceback" not in res.stderr and "internal error" not in res.stderr
        error = by_host(report)["dev0"]["error"]
        assert report["hosts"][0]["state"] == "failed" and error.startswith("upload verifier: "), error
        assert "\n" not in error and all(w in error for w in words), error
        assert not (hosts[0].root / ".edgeq" / "safebundle.py").exists()
        assert list(hosts[0].root.rglob("*.part")) == [] and current(hosts[0]) is None
    finally:
        hosts[0].kill()
