"""One host over SSH (fabric): host keys checked, every step bounded by a timeout, each step's failure one
``HostFailure`` line naming the step; uploads verified by their digest before they are renamed into place."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

from edgeq.fleet.config import Fleet, Host


class HostFailure(Exception):
    """A step on one host failed; ``str()`` says which and why."""


def _why(err: BaseException) -> str:
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def plain(text: str, limit: int = 300) -> str:
    """Device output made safe to print: control characters (terminal escapes) shown as escapes, length capped."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Device:
    """An SSH session to one host with host keys checked (unknown or changed keys are refused)."""

    def __init__(self, host: Host, fleet: Fleet):
        import logging

        import fabric
        import paramiko

        logging.getLogger("paramiko").setLevel(logging.CRITICAL)  # failures are reported per host instead
        self.host, self.fleet = host, fleet
        self._sftp: bool | None = None  # does the host serve SFTP? (asked at the first upload)
        kwargs: dict[str, Any] = {"banner_timeout": fleet.connect_timeout, "auth_timeout": fleet.connect_timeout}
        if host.key:
            kwargs.update(key_filename=host.key, look_for_keys=False, allow_agent=False)
        config = fabric.Config(overrides={"load_ssh_configs": False})
        self.conn = fabric.Connection(host.address, user=host.user, port=host.port, config=config,
                                      connect_timeout=int(max(1, fleet.connect_timeout)), connect_kwargs=kwargs)
        client = self.conn.client
        if fleet.known_hosts is not None and fleet.known_hosts.exists():
            client.load_host_keys(str(fleet.known_hosts))
        if fleet.trust_on_first_use:
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            self.conn.open()
        except paramiko.BadHostKeyException:
            raise HostFailure("connect: host key changed (not the one in known_hosts); refusing to talk to it") from None
        except paramiko.SSHException as err:
            if "not found in known_hosts" in str(err):
                raise HostFailure("connect: unknown host key (not in known_hosts); add it or set trust_on_first_use") from None
            raise HostFailure(f"connect: {err}") from None
        except (OSError, EOFError) as err:
            raise HostFailure(f"connect: {_why(err)}") from None
        if fleet.trust_on_first_use and fleet.known_hosts is not None:
            client.save_host_keys(str(fleet.known_hosts))

    def run(self, command: str, step: str, timeout: float | None = None) -> str:
        from invoke.exceptions import CommandTimedOut, UnexpectedExit

        try:
            result = self.conn.run(command, hide=True, warn=False, timeout=timeout or self.fleet.command_timeout,
                                   in_stream=False)
        except UnexpectedExit as err:
            text = (err.result.stderr.strip() or err.result.stdout.strip() or f"exit {err.result.exited}").splitlines()
            raise HostFailure(f"{step}: {plain(text[-1].strip())}") from None
        except CommandTimedOut:
            raise HostFailure(f"{step}: timed out after {timeout or self.fleet.command_timeout:.0f} s") from None
        except (OSError, EOFError) as err:
            raise HostFailure(f"{step}: connection lost ({err})") from None
        return result.stdout

    def put(self, local: Path, remote: str, step: str) -> None:
        """Copy ``local`` to ``remote`` as ``remote.part``, check its size and SHA-256 there, then rename it into
        place: a file is whole or absent. Over SFTP where the host offers it, else streamed through an exec
        channel (``cat``; minimal images and dropbear often have no SFTP subsystem)."""
        part = remote + ".part"
        digest, size = _sha256(local)
        if self._has_sftp(step):
            try:
                self.conn.put(str(local), part)
            except (OSError, EOFError) as err:
                raise HostFailure(f"{step}: connection lost ({_why(err)})") from None
            except Exception as err:  # paramiko raises SSHException subclasses mid-transfer
                raise HostFailure(f"{step}: connection lost ({type(err).__name__}: {err})") from None
        else:
            self._stream(local, part, step)
        self.run(_checked_rename(part, remote, digest, size, self.host.python), step)

    def _alive(self) -> bool:
        transport = self.conn.client.get_transport()
        return transport is not None and transport.is_active()

    def _has_sftp(self, step: str) -> bool:
        """Whether the host serves SFTP (asked once per connection). A refused subsystem closes only its channel:
        the connection stays up, and that is how "no SFTP" is told from "connection lost"."""
        if self._sftp is None:
            try:
                self.conn.sftp()
                self._sftp = True
            except Exception as err:  # paramiko: SSHException("Channel closed."), EOFError, ...
                if not self._alive():
                    raise HostFailure(f"{step}: connection lost ({type(err).__name__}: {err})") from None
                self._sftp = False
        return self._sftp

    def _stream(self, local: Path, part: str, step: str) -> None:
        """``cat > part`` on the host with the file on its standard input, within ``command_timeout``. What
        arrived is checked by ``put`` (a command that ended early leaves a short file: refused there)."""
        import socket

        timeout = self.fleet.command_timeout
        deadline = time.monotonic() + timeout
        late = HostFailure(f"{step}: timed out after {timeout:.0f} s")
        chan, failed = None, None
        try:
            try:
                chan = self.conn.client.get_transport().open_session(timeout=self.fleet.connect_timeout)
                chan.settimeout(timeout)
                chan.exec_command("cat > " + shlex.quote(part))
                with open(local, "rb") as f:
                    while chunk := f.read(1 << 16):
                        if time.monotonic() > deadline:
                            raise late
                        chan.sendall(chunk)
                chan.shutdown_write()
            except HostFailure:
                raise
            except socket.timeout:
                raise late from None
            except Exception as err:  # the channel was refused or closed under us: by the host, or the connection?
                if not self._alive():
                    raise HostFailure(f"{step}: connection lost ({type(err).__name__}: {err})") from None
                failed = f"{type(err).__name__}: {err}"
            wait = max(0.0, min(deadline - time.monotonic(), 5 if failed else timeout))
            if chan is not None and chan.status_event.wait(wait):
                status = chan.exit_status
            elif failed is None:
                raise late
            else:
                status = None
            said = _channel_stderr(chan)
        finally:
            if chan is not None:
                chan.close()
        if status != 0:
            why = plain(said or failed or f"exit {status}", 120)
            raise HostFailure(f"{step}: the host has no SFTP subsystem and copying through 'cat' over SSH failed too "
                              f"({why}); enable SFTP on the device ('Subsystem sftp internal-sftp' in OpenSSH's "
                              "sshd_config, or dropbear's sftp-server) or give the account a POSIX shell with cat")

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass


def _sha256(path: Path) -> tuple[str, int]:
    import hashlib

    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# The SHA-256 of a file on the device: sha256sum (coreutils, busybox), else openssl, else the device's python.
_DEVICE_SHA256 = ('if command -v sha256sum >/dev/null 2>&1; then d=$(sha256sum < "$f"); '
                  'elif command -v openssl >/dev/null 2>&1; then d=$(openssl dgst -sha256 -r < "$f"); '
                  'else d=$({python} -c {script} < "$f"); fi; d=${{d%% *}}')
_PY_SHA256 = ("import hashlib, sys\nh = hashlib.sha256()\nfor c in iter(lambda: sys.stdin.buffer.read(1 << 20), b''):\n"
              "    h.update(c)\nprint(h.hexdigest())")


def _checked_rename(part: str, remote: str, digest: str, size: int, python: str) -> str:
    """A device command: ``part`` renamed to ``remote`` if its SHA-256 is ``digest``; else removed, one line."""
    return (f"f={shlex.quote(part)}; " + _DEVICE_SHA256.format(python=shlex.quote(python), script=shlex.quote(_PY_SHA256))
            + f'; if [ "$d" = {digest} ]; then mv -f "$f" {shlex.quote(remote)}; else n=$(wc -c < "$f"); rm -f "$f"; '
            f'echo "the copy on the device ($n bytes, SHA-256 $d) is not the file sent ({size} bytes, SHA-256 '
            f'{digest}); retry" >&2; exit 1; fi')


def _channel_stderr(chan) -> str:
    """What a finished exec channel wrote on stderr (its last line), without waiting."""
    if chan is None:
        return ""
    data = b""
    try:
        while chan.recv_stderr_ready() and len(data) < 1 << 16:
            data += chan.recv_stderr(4096)
    except Exception:
        pass
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1].strip() if lines else ""
