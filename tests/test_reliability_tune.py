"""edgeq tune: every remote step has the --timeout deadline, against a real TVM RPC tracker and servers on
127.0.0.1: a dead tracker, a tracker without the device, a device that hangs (its server stopped with
SIGSTOP) before the search and in the middle of a measurement. Each ends with one line, within a few
seconds of the deadline."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_rpc import _conv_model, free_port, start, stop, wait_for_key

from edgeq.errors import RemoteError


def closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


def tune_cli(model: Path, rpc: str, key: str, timeout: float, records: Path) -> tuple[subprocess.CompletedProcess, float]:
    """``edgeq tune`` in a fresh process (every line it prints on stderr counts) and its wall time."""
    start_t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "edgeq", "tune", str(model), "--device", "host", "--rpc", rpc,
                           "--key", key, "--timeout", str(timeout), "--records", str(records)],
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start_t


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 8 and len(lines) == 1 and lines[0].startswith("edgeq: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tracker():
    """A real tracker with one CPU server ('cpu-test') registered."""
    port = free_port()
    proc = start("rpc", "tracker", "--port", port)
    addr = f"127.0.0.1:{port}"
    server = start("rpc", "serve", "--tracker", addr, "--key", "cpu-test", "--port", free_port(), "--port-end", "65000",
                   "--cuda-bridge", "off")
    try:
        wait_for_key(addr, "cpu-test")
        yield addr
    finally:
        stop(server)
        stop(proc)


@pytest.fixture
def hung(tracker):
    """A server registered under 'hung', then stopped (SIGSTOP): it accepts TCP connections, never answers."""
    server = start("rpc", "serve", "--tracker", tracker, "--key", "hung", "--port", free_port(), "--port-end", "65000",
                   "--cuda-bridge", "off")
    try:
        wait_for_key(tracker, "hung")
        yield tracker, server
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGCONT)
        stop(server)


def test_dead_tracker(tmp_path):
    proc, took = tune_cli(_conv_model(tmp_path / "conv.onnx"), f"127.0.0.1:{closed_port()}", "k", 3, tmp_path / "t.json")
    assert "connect to tracker" in one_line(proc) and "3 s" in proc.stderr
    assert took < 3 + 12 and not (tmp_path / "t.json").exists()


def test_no_device_for_the_key(tracker, tmp_path):
    proc, took = tune_cli(_conv_model(tmp_path / "conv.onnx"), tracker, "nobody-serves-this", 3, tmp_path / "t.json")
    assert "request a 'nobody-serves-this' device" in one_line(proc) and "no answer within 3 s" in proc.stderr
    assert took < 3 + 12


def test_hung_device_before_the_search(hung, tmp_path):
    tracker_addr, server = hung
    os.killpg(server.pid, signal.SIGSTOP)
    proc, took = tune_cli(_conv_model(tmp_path / "conv.onnx"), tracker_addr, "hung", 3, tmp_path / "t.json")
    assert "'hung' device" in one_line(proc) and "no answer within 3 s" in proc.stderr
    assert took < 3 + 12


def test_measurement_steps_have_the_deadline(hung, tmp_path):
    """The steps meta_schedule runs in its worker (upload, load, clean up) give up after the deadline when the
    device stops answering mid-measurement (meta_schedule's own versions wait forever)."""
    from tvm.s_tir import meta_schedule as ms

    from edgeq.rpc.tune import _cleanup, _create_session, _upload_module

    tracker_addr, server = hung
    host, port = tracker_addr.rsplit(":", 1)
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key="hung", session_timeout_sec=30)
    session = _create_session(config)
    candidate = tmp_path / "candidate.so"
    candidate.write_bytes(b"\0" * 1024)
    os.killpg(server.pid, signal.SIGSTOP)  # the device hangs with a session open
    start_t = time.monotonic()
    with pytest.raises(RemoteError, match="upload a candidate to the device: no answer within 2 s"):
        _upload_module(2, session, str(candidate), "candidate.so")
    assert time.monotonic() - start_t < 2 + 3
    start_t = time.monotonic()
    _cleanup(2, session, "candidate.so")  # in a finally: never raises, never waits past the deadline
    assert time.monotonic() - start_t < 2 + 3


def test_a_device_gone_mid_search_ends_it(hung):
    """The runner's first measurement that cannot get a session stops the search with its reason (instead of
    failing every remaining trial one deadline at a time); later batches are refused at once."""
    from tvm.s_tir import meta_schedule as ms

    from edgeq.rpc.tune import _runner

    tracker_addr, server = hung
    host, port = tracker_addr.rsplit(":", 1)
    runner, failure, _ = _runner(host, int(port), "hung", 2)
    os.killpg(server.pid, signal.SIGSTOP)
    start_t = time.monotonic()
    futures = runner.run([ms.runner.RunnerInput("/nonexistent/candidate.so", "llvm", [])])
    while not futures[0].done():
        assert time.monotonic() - start_t < 2 * 2 + 10
        time.sleep(0.05)
    with pytest.raises(Exception, match="request a 'hung' device from the tracker: no answer within 2 s"):
        futures[0].result()
    assert failure and "no answer within 2 s" in failure[0]
    with pytest.raises(Exception, match="no answer within 2 s"):
        runner.run([ms.runner.RunnerInput("/nonexistent/candidate.so", "llvm", [])])


def test_a_failed_measurement_is_a_result_not_the_end(tracker, tmp_path):
    """A candidate that fails on a device that answers (here: a file that is no library) is one failed trial;
    the search goes on."""
    from tvm.s_tir import meta_schedule as ms

    from edgeq.rpc.tune import _runner

    host, port = tracker.rsplit(":", 1)
    runner, failure, _ = _runner(host, int(port), "cpu-test", 20)
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a shared library")
    futures = runner.run([ms.runner.RunnerInput(str(bogus), "llvm", [])])
    deadline = time.monotonic() + 60
    while not futures[0].done():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    result = futures[0].result()
    assert result.run_secs is None and result.error_msg and not failure


def test_a_tracker_gone_mid_search_ends_it_quietly(capfd):
    """The tracker dies between measurements: the next one gives up after the deadline with the reason, and
    the worker process prints no TVM retry warnings on the way."""
    from tvm.s_tir import meta_schedule as ms

    from edgeq.rpc.tune import _runner

    port = closed_port()
    runner, failure, _ = _runner("127.0.0.1", port, "k", 2)
    start_t = time.monotonic()
    futures = runner.run([ms.runner.RunnerInput("/nonexistent/candidate.so", "llvm", [])])
    while not futures[0].done():
        assert time.monotonic() - start_t < 2 + 10
        time.sleep(0.05)
    with pytest.raises(Exception, match=f"connect to tracker 127.0.0.1:{port}: no answer within 2 s"):
        futures[0].result()
    assert failure and "Cannot connect to tracker" not in capfd.readouterr().err


def test_the_pools_only_device_killed_mid_tune_keeps_the_records(tracker, tmp_path):
    """The only device under the key is killed (SIGKILL) once tuning started: edgeq tune ends in one line saying
    why and where the measurements are, exit 8, and the records found so far are in the file (it printed
    "internal error: RuntimeError ... no answer within 10 s" and kept none)."""
    import json

    server = start("rpc", "serve", "--tracker", tracker, "--key", "doomed", "--port", free_port(), "--port-end", "65000",
                   "--cuda-bridge", "off")
    try:
        wait_for_key(tracker, "doomed")
        model = _conv_model(tmp_path / "conv.onnx")
        records = tmp_path / "tuning.json"
        proc = subprocess.Popen([sys.executable, "-m", "edgeq", "tune", str(model), "--device", "host", "--rpc", tracker,
                                 "--key", "doomed", "--timeout", "4", "--trials", "64", "--records", str(records)],
                                stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stderr:  # progress notes, then the error
            lines.append(line.rstrip("\n"))
            if ": tuning " in line and server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        stop(server)
    assert any(": tuning " in line for line in lines), lines
    assert proc.returncode == 8, lines
    assert "Traceback" not in "\n".join(lines) and "internal error" not in "\n".join(lines)
    assert lines[-1].startswith("edgeq: error: tuning ") and f"measurements so far are in {records}" in lines[-1], lines
    kept = [json.loads(line) for line in records.read_text().splitlines()]
    assert kept and all(r["profile"] == "host" for r in kept)  # at least edgeq's own schedule, measured first
