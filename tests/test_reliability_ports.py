"""edgeq rpc tracker / serve ports: a --port alone (above the old fixed --port-end 9199, the issue's case)
works, the end following it; a bad range is one line, exit 2, no traceback. Real processes on 127.0.0.1."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import run_cli
from test_rpc import free_port, start, stop, wait_for_key


def free_port_above(low: int) -> int:
    """A port above ``low`` that is free now, with the nine after it inside the port range."""
    while True:
        port = free_port()
        if low < port <= 65526:
            return port


def test_tracker_and_server_with_a_port_alone_above_9199():
    port = free_port_above(9199)
    tracker = subprocess.Popen([sys.executable, "-m", "edgeq", "rpc", "tracker", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    server = None
    try:
        assert tracker.stdout.readline().startswith(f"edgeq rpc tracker on 127.0.0.1:{port} "), tracker.stderr
        addr = f"127.0.0.1:{port}"
        server = start("rpc", "serve", "--tracker", addr, "--key", "alone", "--port", free_port_above(9199),
                       "--cuda-bridge", "off")
        wait_for_key(addr, "alone", 30)
    finally:
        if server is not None:
            stop(server)
        os.killpg(tracker.pid, signal.SIGKILL)
        tracker.wait()
    assert "Traceback" not in tracker.stderr.read()


def test_tracker_moves_past_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        if port > 65526:
            pytest.skip("the ephemeral port is too close to 65535 for a range of ten")
        proc = subprocess.Popen([sys.executable, "-m", "edgeq", "rpc", "tracker", "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            line = proc.stdout.readline()
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    got = int(line.split("127.0.0.1:")[1].split()[0])
    assert port < got < port + 10, line


@pytest.mark.parametrize("verb", ["tracker", "serve"])
@pytest.mark.parametrize("args, words", [
    (["--port", "29311", "--port-end", "29311"], ["--port-end must be above --port (29311)", "not 29311"]),
    (["--port", "29311", "--port-end", "9199"], ["--port-end must be above --port (29311)", "not 9199"]),
    (["--port", "29311", "--port-end", "65537"], ["at most 65536", "not 65537"]),
    (["--port", "65536"], ["--port must be from 1 to 65535", "not 65536"]),
    (["--port", "0"], ["--port must be from 1 to 65535", "not 0"]),
])
def test_a_bad_range_is_one_line(verb, args, words):
    extra = ["--tracker", f"127.0.0.1:{free_port()}", "--key", "k", "--cuda-bridge", "off"] if verb == "serve" else []
    res = run_cli("rpc", verb, *extra, *args)
    lines = res.stderr.strip().splitlines()
    assert res.code == 2 and len(lines) == 1 and lines[0].startswith("edgeq: error: "), res.stderr
    assert all(w in lines[0] for w in words), lines[0]
