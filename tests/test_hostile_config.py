"""Hostile and broken input to flash / fleet / rollback / rpc / bench / tune / keygen: one line on stderr, the
documented exit status, nothing half-written and nothing changed. Never a traceback, never a wrong yes."""

import getpass
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_cli
from sshd import SSHD, free_port, make_hosts


def refused(res, code: int, *words: str) -> str:
    """Exactly one stderr line, 'edgeq: error: ...', naming ``words``; exit status ``code``."""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeq: error: "), res.stderr
    assert res.code == code, (res.code, res.stderr)
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"")
            for p in sorted(folder.rglob("*")) if not p.is_symlink()}


def closed_port() -> int:
    return free_port()  # bound and closed again: nothing listens there


# ---- fleet.toml ----------------------------------------------------------------------------------------


def host_key_line() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    pub = ed25519.Ed25519PrivateKey.generate().public_key()
    return "[127.0.0.1]:2222 " + pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


GOOD_TOP = ['known_hosts = "known_hosts"', "connect_timeout = 3", "command_timeout = 60"]


def good_host(name: str = "dev0", port: int = 2222) -> list[str]:
    return ["[[hosts]]", f'name = "{name}"', 'address = "127.0.0.1"', f"port = {port}", f'user = "{getpass.getuser()}"',
            'root = "/nonexistent/edgeq-root"', 'tags = ["canary"]']


def fleet_dir(tmp_path: Path, top: list[str] | None = None, hosts: list[str] | None = None,
              known_hosts: str | None = None) -> Path:
    (tmp_path / "known_hosts").write_text(host_key_line() + "\n" if known_hosts is None else known_hosts)
    (tmp_path / "bundle.tar.gz").write_bytes(b"never opened: the fleet file is refused first")
    text = "\n".join((GOOD_TOP if top is None else top) + (good_host() if hosts is None else hosts)) + "\n"
    (tmp_path / "fleet.toml").write_text(text)
    return tmp_path / "fleet.toml"


def replace(lines: list[str], key: str, value: str | None) -> list[str]:
    """``lines`` with ``key = ...`` set to ``value`` (None: removed); added when missing."""
    out = [line for line in lines if not line.startswith(f"{key} =")]
    if value is None:
        return out
    at = next((i + 1 for i, line in enumerate(out) if line == "[[hosts]]"), len(out))
    return out[:at] + [f"{key} = {value}"] + out[at:]


FLEET_CASES = {
    # name: (top-level lines, host lines, known_hosts text or None, words the one line must hold)
    "hosts-not-a-list": (GOOD_TOP + ["hosts = 5"], [], None, ["hosts must be a list"]),
    "host-not-a-table": (GOOD_TOP + ["hosts = [1, 2]"], [], None, ["hosts[0] must be a table"]),
    "no-hosts": (GOOD_TOP, [], None, ["lists no [[hosts]]"]),
    "connect-timeout-text": (replace(GOOD_TOP, "connect_timeout", '"abc"'), None, None, ["connect_timeout must be a number of seconds", "'abc'"]),
    "connect-timeout-negative": (replace(GOOD_TOP, "connect_timeout", "-1"), None, None, ["connect_timeout", "-1"]),
    "connect-timeout-nan": (replace(GOOD_TOP, "connect_timeout", "nan"), None, None, ["connect_timeout", "nan"]),
    "connect-timeout-inf": (replace(GOOD_TOP, "connect_timeout", "inf"), None, None, ["connect_timeout", "inf"]),
    "command-timeout-zero": (replace(GOOD_TOP, "command_timeout", "0"), None, None, ["command_timeout must be"]),
    "command-timeout-bool": (replace(GOOD_TOP, "command_timeout", "true"), None, None, ["command_timeout must be"]),
    "known-hosts-number": (replace(GOOD_TOP, "known_hosts", "5"), None, None, ["known_hosts must be a non-empty string"]),
    "known-hosts-missing": (replace(GOOD_TOP, "known_hosts", '"nowhere"'), None, None, ["known_hosts file", "not found"]),
    "known-hosts-unset": (replace(GOOD_TOP, "known_hosts", None), None, None, ["needs known_hosts"]),
    "tofu-not-bool": (GOOD_TOP + ['trust_on_first_use = "yes"'], None, None, ["trust_on_first_use must be true or false"]),
    "public-key-list": (GOOD_TOP + ["public_key = [1]"], None, None, ["public_key must be a non-empty string"]),
    "public-key-missing": (GOOD_TOP + ['public_key = "nokey.pub"'], None, None, ["public_key", "is not a file"]),
    "root-number": (GOOD_TOP + ["root = 5"], None, None, ["root must be an absolute path"]),
    "root-relative": (GOOD_TOP + ['root = "opt/edgeq"'], None, None, ["root must be an absolute path"]),
    "unknown-top-key": (GOOD_TOP + ["conect_timeout = 3"], None, None, ["unknown key 'conect_timeout'"]),
    "unknown-host-key": (GOOD_TOP, good_host() + ["prot = 22"], None, ["unknown key 'hosts[0].prot'"]),
    "port-too-big": (GOOD_TOP, replace(good_host(), "port", "65536"), None, ["hosts[0].port must be an integer from 1 to 65535", "65536"]),
    "port-zero": (GOOD_TOP, replace(good_host(), "port", "0"), None, ["hosts[0].port", "not 0"]),
    "port-negative": (GOOD_TOP, replace(good_host(), "port", "-1"), None, ["hosts[0].port", "not -1"]),
    "port-string": (GOOD_TOP, replace(good_host(), "port", '"22"'), None, ["hosts[0].port", "'22'"]),
    "port-float": (GOOD_TOP, replace(good_host(), "port", "22.0"), None, ["hosts[0].port"]),
    "host-root-number": (GOOD_TOP, replace(good_host(), "root", "5"), None, ["hosts[0].root must be an absolute path"]),
    "name-missing": (GOOD_TOP, replace(good_host(), "name", None), None, ["hosts[0] needs 'name' and 'address'"]),
    "name-twice": (GOOD_TOP, good_host("dev0") + good_host("dev0"), None, ["'dev0' appears twice", "hosts[0] and hosts[1]"]),
    "name-space": (GOOD_TOP, replace(good_host(), "name", '"dev 0"'), None, ["hosts[0].name must be a name"]),
    "name-markup": (GOOD_TOP, replace(good_host(), "name", '"[/x]"'), None, ["hosts[0].name must be a name", "[/x]"]),
    "name-path": (GOOD_TOP, replace(good_host(), "name", '"../x"'), None, ["hosts[0].name must be a name"]),
    "name-escape": (GOOD_TOP, replace(good_host(), "name", '"a\\u001b[2J"'), None, ["hosts[0].name must be a name"]),
    "address-space": (GOOD_TOP, replace(good_host(), "address", '"1.2.3.4 -oProxyCommand=x"'), None, ["hosts[0].address must be"]),
    "tags-string": (GOOD_TOP, replace(good_host(), "tags", '"canary"'), None, ["hosts[0].tags must be a list of strings"]),
    "tags-numbers": (GOOD_TOP, replace(good_host(), "tags", "[1]"), None, ["hosts[0].tags must be a list of strings"]),
    "python-number": (GOOD_TOP, good_host() + ["python = 3"], None, ["hosts[0].python must be a non-empty string"]),
    "known-hosts-bad-line": (GOOD_TOP, None, "# comment\n" + host_key_line() + "\n[127.0.0.1]:2 ssh-ed25519 !!notbase64\n",
                             ["known_hosts file", "line 3"]),
    "known-hosts-two-fields": (GOOD_TOP, None, "127.0.0.1 ssh-ed25519\n", ["known_hosts file", "line 1"]),
    "not-toml": (["hosts = [[["], [], None, ["is not valid TOML"]),
}

VERBS = {
    "flash": lambda f: ["flash", f.parent / "bundle.tar.gz", "--fleet", f],
    "status": lambda f: ["fleet", "status", "--fleet", f],
    "rollback": lambda f: ["rollback", "--fleet", f],
}


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("case", FLEET_CASES)
def test_bad_fleet_file_is_one_line_and_touches_nothing(tmp_path, case, verb):
    top, hosts, known, words = FLEET_CASES[case]
    fleet = fleet_dir(tmp_path, top, hosts, known)
    before = snapshot(tmp_path)
    res = run_cli(*VERBS[verb](fleet))
    refused(res, 2, *words)
    assert snapshot(tmp_path) == before and res.stdout == ""


@pytest.mark.parametrize("option, value", [("--batch", "-1"), ("--batch", "0"), ("--parallel", "0"), ("--parallel", "-3"),
                                           ("--parallel", "100000"), ("--canary", "-1"), ("--canary", "101%"),
                                           ("--canary", "nan%"), ("--canary", "-5%"), ("--max-failures", "-1"),
                                           ("--max-failures", "inf%"), ("--max-failures", "1e9"), ("--batch", "x")])
def test_flash_numbers_are_usage_errors(tmp_path, option, value):
    fleet = fleet_dir(tmp_path)
    before = snapshot(tmp_path)
    res = run_cli("flash", tmp_path / "bundle.tar.gz", "--fleet", fleet, option, value)
    refused(res, 2, option)
    assert snapshot(tmp_path) == before


def test_rollback_of_a_host_not_in_the_fleet(tmp_path):
    fleet = fleet_dir(tmp_path, hosts=good_host("dev0", closed_port()) + good_host("dev1", closed_port()))
    start = time.monotonic()
    res = run_cli("rollback", "--fleet", fleet, "--host", "dev9", "--host", "dev0")
    refused(res, 2, "no host 'dev9'", "dev0, dev1")
    assert time.monotonic() - start < 5  # refused before connecting to anything


# ---- device output is untrusted text -------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(models, tmp_path_factory):
    res = run_cli("package", models["mobilenet_cnn"], "--device", "host", "-o", tmp_path_factory.mktemp("hostile"), "-q", "--json")
    assert res.code == 0, res.stderr
    return Path(json.loads(res.stdout)["archive"])


@pytest.mark.skipif(not Path(SSHD).exists(), reason="needs openssh-server (scripts/setup.sh installs it)")
@pytest.mark.parametrize("text, shown", [("[/x] boom", "[/x] boom"), ("[bold boom", "[bold boom"),
                                         ("[red]boom[/red] [/]", "[red]boom[/red] [/]"),
                                         ("\x1b[2J\x1b]0;pwned\x07 boom", "\\x1b[2J\\x1b]0;pwned\\x07 boom")])
def test_device_text_is_printed_verbatim_never_as_markup(tmp_path, bundle, text, shown):
    hosts, key = make_hosts(tmp_path / "ssh", 1)
    try:
        (tmp_path / "says").write_text(text + "\n")
        python = tmp_path / "hostile-python"
        python.write_text(f"#!/bin/sh\ncat {tmp_path / 'says'} >&2\nexit 1\n")
        python.chmod(0o755)
        (tmp_path / "known_hosts").write_text(hosts[0].known_hosts_line() + "\n")
        fleet = tmp_path / "fleet.toml"
        fleet.write_text("\n".join(GOOD_TOP + [
            "[[hosts]]", 'name = "dev0"', 'address = "127.0.0.1"', f"port = {hosts[0].port}", f'user = "{getpass.getuser()}"',
            f'key = "{key}"', f'python = "{python}"', f'root = "{hosts[0].root}"']) + "\n")
        for argv in (["flash", bundle, "--fleet", fleet], ["fleet", "status", "--fleet", fleet],
                     ["rollback", "--fleet", fleet, "--host", "dev0"]):
            res = run_cli(*argv)
            assert res.code == 1, (argv, res.stderr)
            assert "internal error" not in res.stderr and "Traceback" not in res.stderr
            assert shown in res.stdout and "\x1b" not in res.stdout + res.stderr, res.stdout
        assert not (hosts[0].root / "current").exists()
        report = json.loads(run_cli("flash", bundle, "--fleet", fleet, "--json").stdout)
        assert report["hosts"][0]["state"] == "failed" and report["hosts"][0]["error"] == f"status: {shown}"
    finally:
        hosts[0].kill()


# ---- rpc tracker / serve -------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--port", "0"], ["--port must be from 1 to 65535", "not 0"]),
    (["--port", "-1"], ["--port must be from 1 to 65535", "not -1"]),
    (["--port", "70000"], ["--port must be from 1 to 65535", "not 70000"]),
    (["--port", "9300", "--port-end", "9300"], ["--port-end must be above --port"]),
    (["--port", "9300", "--port-end", "70000"], ["--port-end", "65536"]),
    (["--host", "999.1.1.1"], ["--host 999.1.1.1 is not an address"]),
    (["--host", "192.0.2.1"], ["cannot listen on 192.0.2.1"]),
    (["--port", "x"], ["--port"]),
])
def test_rpc_tracker_bad_arguments(args, words):
    refused(run_cli("rpc", "tracker", *args), 2, *words)


def test_rpc_tracker_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        refused(run_cli("rpc", "tracker", "--port", port, "--port-end", port + 1), 2, f"port {port} is in use")


def test_rpc_tracker_port_alone_works():
    """--port without --port-end tries PORT to PORT + 9 (it used to die: port-end defaulted to 9199)."""
    from edgeq.rpc.session import wait_for_tracker

    port = free_port()
    while port > 65526:
        port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgeq", "rpc", "tracker", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().startswith("edgeq rpc tracker on 127.0.0.1:")
        wait_for_tracker(f"127.0.0.1:{port}", 30)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.parametrize("args, words", [
    (["--port", "70000"], ["--port must be from 1 to 65535"]),
    (["--port", "0"], ["--port must be from 1 to 65535"]),
    (["--timeout", "nan"], ["--timeout must be from 1 to 86400", "nan"]),
    (["--timeout", "-1"], ["--timeout must be from 1 to 86400"]),
    (["--timeout", "inf"], ["--timeout", "inf"]),
    (["--key", "two words"], ["--key must be"]),
    (["--tracker", "127.0.0.1:70000"], ["is not HOST:PORT"]),
    (["--tracker", "nocolon"], ["is not HOST:PORT"]),
    (["--host", "999.1.1.1"], ["--host 999.1.1.1"]),
])
def test_rpc_serve_bad_arguments(args, words):
    base = {"--tracker": f"127.0.0.1:{closed_port()}", "--key": "k", "--cuda-bridge": "off"}
    base.update(dict(zip(args[::2], args[1::2])))
    start = time.monotonic()
    refused(run_cli("rpc", "serve", *[x for kv in base.items() for x in kv]), 2, *words)
    assert time.monotonic() - start < 5  # refused before waiting for any tracker


def test_rpc_serve_gives_up_on_an_unreachable_tracker():
    """It used to retry forever; now one line after --timeout (a fresh process: no TVM log lines either)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "edgeq", "rpc", "serve", "--tracker", f"127.0.0.1:{closed_port()}",
                           "--key", "k", "--port", str(free_port()), "--cuda-bridge", "off", "--timeout", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 8 and proc.stdout == "", proc
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "unreachable for 3 s" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 20


def test_rpc_serve_refuses_something_that_is_not_a_tracker():
    with socket.socket() as imposter:
        imposter.bind(("127.0.0.1", 0))
        imposter.listen()

        def answer():
            while True:
                try:
                    conn, _ = imposter.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(4)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        threading.Thread(target=answer, daemon=True).start()
        res = run_cli("rpc", "serve", "--tracker", f"127.0.0.1:{imposter.getsockname()[1]}", "--key", "k",
                      "--port", free_port(), "--cuda-bridge", "off", "--timeout", "10")
    refused(res, 8, "is not a TVM RPC tracker")


# ---- bench / tune --------------------------------------------------------------------------------------


@pytest.mark.parametrize("option, value, limit", [
    ("--timeout", "nan", "from 1 to 86400"), ("--timeout", "-1", "from 1 to 86400"), ("--timeout", "inf", "86400"),
    ("--timeout", "0", "from 1"), ("--repeat", "4294967297", "from 1 to 1000000"), ("--repeat", "0", "from 1"),
    ("--warmup", "-1", "from 0 to 1000000"), ("--session-timeout", "nan", "from 0 to 86400"),
    ("--session-timeout", "-5", "from 0"), ("--repeat", "1e3", "invalid int value"),
])
def test_bench_numbers_are_bounded(tmp_path, option, value, limit):
    res = run_cli("bench", tmp_path / "missing.tar.gz", option, value)
    refused(res, 2, option, limit)


def test_bench_rpc_port_out_of_range(tmp_path):
    refused(run_cli("bench", tmp_path / "missing.tar.gz", "--rpc", "127.0.0.1:99999", "--key", "k"), 2, "is not HOST:PORT")


def conv_model(path: Path) -> Path:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def tune(tmp_path, *extra):
    return run_cli("tune", conv_model(tmp_path / "conv.onnx"), "--device", "host", "--rpc", f"127.0.0.1:{closed_port()}",
                   "--key", "k", *extra)


@pytest.mark.parametrize("option, value, words", [
    ("--trials", "0", ["--trials must be from 1 to 100000", "not 0"]), ("--trials", "-1", ["--trials", "not -1"]),
    ("--trials", "100001", ["--trials"]), ("--timeout", "nan", ["--timeout must be from 1 to 86400"]),
    ("--timeout", "0", ["--timeout"]), ("--records", ".", ["is not a file"]),
    ("--records", "no/such/folder/tuning.json", ["does not exist"]),
])
def test_tune_arguments(tmp_path, monkeypatch, option, value, words):
    monkeypatch.chdir(tmp_path)
    res = tune(tmp_path, option, value)
    refused(res, 2, option, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.onnx"]


def test_tune_against_a_dead_tracker_honours_timeout(tmp_path):
    """It used to retry every 5 s for over 6 minutes; now --timeout bounds it (a fresh process: every stderr line)."""
    model = conv_model(tmp_path / "conv.onnx")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "edgeq", "tune", str(model), "--device", "host", "--rpc",
                           f"127.0.0.1:{closed_port()}", "--key", "k", "--timeout", "3", "--records",
                           str(tmp_path / "tuning.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 8, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "connect to tracker" in proc.stderr and "3 s" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 20
    assert not (tmp_path / "tuning.json").exists()


# ---- keygen --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["edgeq_signing.pub", "edgeq_signing.key"])
def test_keygen_never_writes_through_a_dangling_symlink(tmp_path, name):
    out, target = tmp_path / "keys", tmp_path / "elsewhere" / "target"
    out.mkdir()
    target.parent.mkdir()
    (out / name).symlink_to(target)
    refused(run_cli("keygen", "--out", out), 2, "symbolic link")
    assert not target.exists() and os.listdir(out) == [name] and os.listdir(target.parent) == []


@pytest.mark.parametrize("present", [("edgeq_signing.key", "edgeq_signing.pub"), ("edgeq_signing.pub",), ("edgeq_signing.key",)])
def test_keygen_never_overwrites_a_key(tmp_path, present):
    out = tmp_path / "keys"
    out.mkdir()
    for name in present:
        (out / name).write_text(f"old {name}\n")
    before = snapshot(out)
    refused(run_cli("keygen", "--out", out), 2, "already holds a signing key", "never overwritten")
    assert snapshot(out) == before


def test_keygen_out_is_a_file(tmp_path):
    (tmp_path / "keys").write_text("a file\n")
    refused(run_cli("keygen", "--out", tmp_path / "keys"), 2, "is a file")
    assert (tmp_path / "keys").read_text() == "a file\n"


def test_keygen_writes_both_files_once(tmp_path):
    res = run_cli("keygen", "--out", tmp_path / "k", "--json")
    assert res.code == 0 and res.stderr == ""
    assert (tmp_path / "k" / "edgeq_signing.key").stat().st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path / "k")) == ["edgeq_signing.key", "edgeq_signing.pub"]
