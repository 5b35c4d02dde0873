"""TVM RPC sessions with a deadline on every step, and the tracker / server edgeq starts.

TVM RPC has no authentication: bind to loopback and reach devices through SSH tunnels."""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from edgeq.errors import RemoteError, UsageError

DAY_S = 86400


def bounded(option: str, value: float, low: float, high: float) -> None:
    """Refuse ``value`` outside [low, high] (nan and inf included) with one line naming the option."""
    if not low <= value <= high:  # nan fails every comparison
        raise UsageError(f"{option} must be from {low} to {high}, not {value}")


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    try:
        if not sep or not host or not 1 <= int(port) <= 65535:
            raise ValueError
        return host, int(port)
    except ValueError:
        raise UsageError(f"'{text}' is not HOST:PORT with a port from 1 to 65535 (for example 127.0.0.1:9190)") from None


def with_deadline(step: str, seconds: float, fn: Callable, *args, **kwargs) -> Any:
    """Run ``fn`` and return its result, or raise RemoteError naming ``step`` when it fails or takes longer
    than ``seconds`` (a hung device, a dead tracker): the caller never hangs."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - reported to the caller below
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True, name=f"edgeq-rpc-{step}")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise RemoteError(f"{step}: no answer within {seconds:g} s (device hung, session lost or tracker unreachable)")
    if "error" in box:
        err = box["error"]
        text = " ".join(str(err).split())[:300] or type(err).__name__
        if "RPCSessionTimeoutError" in text or "session has expired" in text:
            raise RemoteError(f"{step}: the RPC session timed out on the server ({text})")
        raise RemoteError(f"{step}: {text}")
    return box.get("value")


def no_retry_warnings(record: logging.LogRecord) -> bool:
    return "Cannot connect to tracker" not in record.getMessage()


@dataclasses.dataclass
class Remote:
    """A session on a device reached through a tracker."""

    session: Any
    timeout: float

    @classmethod
    def open(cls, rpc: str, key: str, timeout: float = 60.0, session_timeout: float = 0) -> "Remote":
        from tvm import rpc as tvm_rpc

        logging.getLogger("RPCServer").addFilter(no_retry_warnings)  # the deadline below says it in one line
        host, port = parse_addr(rpc)
        tracker = with_deadline(f"connect to tracker {host}:{port}", timeout, tvm_rpc.connect_tracker, host, port)
        session = with_deadline(f"request a '{key}' device from the tracker", timeout, tracker.request, key,
                                priority=1, session_timeout=session_timeout)
        return cls(session, timeout)

    def call(self, step: str, fn: Callable, *args, **kwargs) -> Any:
        return with_deadline(step, self.timeout, fn, *args, **kwargs)


def free_port(host: str, port: int, port_end: int | None) -> int:
    """The first port of [port, port_end) that ``host`` can bind (port_end: default port + 10, at most 65536),
    found before TVM starts: its own bind errors are tracebacks in another process."""
    bounded("--port", port, 1, 65535)
    end = min(port + 10, 65536) if port_end is None else port_end
    if not port < end <= 65536:
        raise UsageError(f"--port-end must be above --port ({port}) and at most 65536 (ports tried: --port to "
                         f"--port-end - 1), not {port_end}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (OSError, UnicodeError) as err:
        raise UsageError(f"--host {host} is not an address ({getattr(err, 'strerror', None) or err}); "
                         "give an address of this machine, e.g. 127.0.0.1") from None
    for candidate in range(port, end):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TVM binds
            try:
                sock.bind((host, candidate))
                return candidate
            except OSError as err:
                if err.errno != errno.EADDRINUSE:
                    raise UsageError(f"cannot listen on {host}:{candidate}: {err.strerror}; give an address of this "
                                     "machine with --host") from None
    span = f"port {port} is" if end == port + 1 else f"ports {port} to {end - 1} are all"
    raise UsageError(f"{span} in use on {host}; choose another --port (or a wider --port-end)")


def run_tracker(host: str, port: int, port_end: int | None = None) -> int:
    """TVM's tracker in the foreground (it needs tornado, psutil and cloudpickle)."""
    import subprocess
    import sys

    port = free_port(host, port, port_end)
    print(f"edgeq rpc tracker on {host}:{port} (no authentication: keep it on loopback or a tunnel)", flush=True)
    try:
        return subprocess.call([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host, "--port", str(port),
                                "--port-end", str(port + 1)])
    except KeyboardInterrupt:
        return 0


def wait_for_tracker(tracker: str, timeout: float) -> None:
    """Return once a TVM RPC tracker answers at ``tracker`` (TCP connect and its magic number), retrying for at
    most ``timeout`` seconds; then one line saying it is unreachable."""
    from tvm.rpc.base import RPC_TRACKER_MAGIC

    host, port = parse_addr(tracker)
    deadline, why = time.monotonic() + timeout, "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.5, min(5.0, deadline - time.monotonic()))) as sock:
                sock.sendall(struct.pack("<i", RPC_TRACKER_MAGIC))
                reply = sock.recv(4, socket.MSG_WAITALL)
            if len(reply) == 4 and struct.unpack("<i", reply)[0] == RPC_TRACKER_MAGIC:
                return
            raise RemoteError(f"{tracker} answers but is not a TVM RPC tracker; check --tracker")
        except socket.gaierror as err:
            raise UsageError(f"--tracker {tracker}: unknown host ({err.strerror})") from None
        except OSError as err:  # refused, unreachable, timed out: the tracker may still be starting
            why = err.strerror or str(err) or type(err).__name__
        if time.monotonic() + 1 >= deadline:
            raise RemoteError(f"tracker {tracker} unreachable for {timeout:g} s ({why}); start 'edgeq rpc tracker' "
                              "there or fix --tracker (--timeout sets the wait)")
        time.sleep(1)


def check_server(tracker: str, key: str, host: str, port: int, port_end: int | None, timeout: float) -> int:
    """Refuse bad ``edgeq rpc serve`` arguments with one line; return the port the server will listen on."""
    parse_addr(tracker)
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise UsageError(f"--key must be a non-empty word without spaces, not {key!r}")
    bounded("--timeout", timeout, 1, DAY_S)
    return free_port(host, port, port_end)


def run_server(tracker: str, key: str, host: str, port: int, port_end: int | None, profile: str | None = None,
               sysfs_root: str = "", timeout: float = 60.0) -> None:
    """A TVM RPC server registered with the tracker, with edgeq's device functions (power sampling). The
    tracker must answer within ``timeout`` seconds."""
    from tvm.rpc.server import PopenRPCServerState

    from edgeq.rpc.device import register
    from edgeq.targets import resolve

    port = check_server(tracker, key, host, port, port_end, timeout)
    wait_for_tracker(tracker, timeout)
    # --device-profile: the rails this device has, preferred over what the client's bundle says
    power = resolve(profile)[0].device_record().power if profile else None
    register(power.to_json() if power else None, sysfs_root)
    failed: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda exc: failed.append(exc.exc_value)
    try:
        try:
            state = PopenRPCServerState(host, port, port + 1, tracker_addr=parse_addr(tracker), key=key, silent=False)
        except (OSError, ValueError) as err:
            raise RemoteError(f"cannot serve on {host}:{port}: {err}") from None
        print(f"edgeq rpc server '{key}' on {host}:{state.port}, registered with {tracker} "
              "(no authentication: keep it on loopback or a tunnel)", flush=True)
        state.thread.join()
    finally:
        threading.excepthook = hook
    why = " ".join(str(failed[0]).split())[:300] if failed else "it stopped"
    raise RemoteError(f"the RPC server stopped: {why} (is the tracker at {tracker} still up?)")
