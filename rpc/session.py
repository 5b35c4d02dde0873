"""TVM RPC sessions with a deadline on every step, and the tracker / server edgeq starts.

TVM RPC has no authentication: bind to loopback and reach devices through SSH tunnels."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from edgeq.errors import RemoteError, UsageError


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    try:
        if not sep or not host:
            raise ValueError
        return host, int(port)
    except ValueError:
        raise UsageError(f"'{text}' is not HOST:PORT (for example 127.0.0.1:9190)") from None


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


@dataclasses.dataclass
class Remote:
    """A session on a device reached through a tracker."""

    session: Any
    timeout: float

    @classmethod
    def open(cls, rpc: str, key: str, timeout: float = 60.0, session_timeout: float = 0) -> "Remote":
        from tvm import rpc as tvm_rpc

        host, port = parse_addr(rpc)
        tracker = with_deadline(f"connect to tracker {host}:{port}", timeout, tvm_rpc.connect_tracker, host, port)
        session = with_deadline(f"request a '{key}' device from the tracker", timeout, tracker.request, key,
                                priority=1, session_timeout=session_timeout)
        return cls(session, timeout)

    def call(self, step: str, fn: Callable, *args, **kwargs) -> Any:
        return with_deadline(step, self.timeout, fn, *args, **kwargs)


def run_tracker(host: str, port: int, port_end: int) -> int:
    """TVM's tracker in the foreground (it needs tornado, psutil and cloudpickle)."""
    import subprocess
    import sys

    print(f"edgeq rpc tracker on {host}:{port} (no authentication: keep it on loopback or a tunnel)", flush=True)
    try:
        return subprocess.call([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host, "--port", str(port),
                                "--port-end", str(port_end)])
    except KeyboardInterrupt:
        return 0


def run_server(tracker: str, key: str, host: str, port: int, port_end: int, profile: str | None = None,
               sysfs_root: str = "") -> None:
    """A TVM RPC server registered with the tracker, with edgeq's device functions (power sampling)."""
    from tvm.rpc.server import PopenRPCServerState

    from edgeq.rpc.bench import profile_power_config
    from edgeq.rpc.device import register

    register(profile_power_config(profile) if profile else None, sysfs_root)
    tracker_addr = parse_addr(tracker)
    state = PopenRPCServerState(host, port, port_end, tracker_addr=tracker_addr, key=key, silent=False)
    print(f"edgeq rpc server '{key}' on {host}:{state.port}, registered with {tracker} "
          "(no authentication: keep it on loopback or a tunnel)", flush=True)
    state.thread.join()
