"""Flash a bundle to a fleet of devices over SSH (fabric): staged, verified, health-checked, atomic, rolled
back on failure.

Per host: connect (known host keys only) -> preflight (profile, architecture, python, TVM or the bundle's runtime, disk) -> upload
the archive and edgeq's stdlib verifier (``safebundle.py``) -> on the device: verify signature and every
file, unpack into ``<root>/releases/<bundle-id>`` (``stage``) -> ``run.py --self-test`` there -> switch
``<root>/current`` atomically (``activate``) -> ``run.py --self-test`` through ``current`` -> prune. A failure
after the switch switches back (``rollback``). Hosts go canaries first, then in batches, ``--parallel`` at a
time; once failures exceed ``--max-failures`` no new host starts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (JetPack 6): the same parser, from PyPI
    import tomli as tomllib

from edgeq import contract, safebundle
from edgeq.contract import HostState
from edgeq.errors import BundleError, UsageError

MAX_HOSTS = 100_000  # bound of --batch, --canary and --max-failures counts
MAX_PARALLEL = 256


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    address: str
    port: int = 22
    user: str | None = None
    key: str | None = None
    python: str = "python3"
    root: str = "/opt/edgeq"
    device: str | None = None
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Fleet:
    path: Path
    hosts: tuple[Host, ...]
    known_hosts: Path
    trust_on_first_use: bool = False
    public_key: Path | None = None
    connect_timeout: float = 10.0
    command_timeout: float = 600.0


def _text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != "" and v.isprintable()


def _seconds(high: float) -> tuple[str, Callable[[Any], bool]]:
    return (f"a number of seconds from 1 to {high:g}",
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 1 <= v <= high)  # nan fails


# what each key of fleet.toml must be: (description for the error, check)
_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "text": ("a non-empty string", _text),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "root": ("an absolute path (a string starting with /)", lambda v: _text(v) and v.startswith("/")),
    "address": ("a host name or IP address (a string without spaces)", lambda v: _text(v) and not any(c.isspace() for c in v)),
    "port": ("an integer from 1 to 65535", lambda v: type(v) is int and 1 <= v <= 65535),
    "name": ("a name of letters, digits, '.', '_' or '-' (at most 64, starting with a letter or digit)",
             lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", v) is not None),
    "tags": ("a list of strings", lambda v: isinstance(v, list) and all(_text(t) for t in v)),
    "connect_timeout": _seconds(3600),
    "command_timeout": _seconds(86400),
}
_TOP_KEYS = {"hosts": None, "known_hosts": "text", "trust_on_first_use": "bool", "public_key": "text", "root": "root",
             "connect_timeout": "connect_timeout", "command_timeout": "command_timeout"}
_HOST_KEYS = {"name": "name", "address": "address", "port": "port", "user": "text", "key": "text", "python": "text",
              "root": "root", "device": "text", "tags": "tags"}


def _checked(path: Path, table: dict, keys: dict[str, str | None], where: str) -> dict[str, Any]:
    """``table`` with every key known and of its kind; otherwise one line naming file, key and kind."""
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise UsageError(f"fleet file {path}: unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(f'{where}{k}') for k in unknown)} (known: {', '.join(keys)})")
    for key, kind in keys.items():
        if kind is not None and key in table and not _KINDS[kind][1](table[key]):
            shown = repr(table[key]) if len(repr(table[key])) <= 40 else repr(table[key])[:37] + "..."
            raise UsageError(f"fleet file {path}: {where}{key} must be {_KINDS[kind][0]}, not {shown}")
    return table


def _check_known_hosts(fleet_path: Path, known_hosts: Path) -> None:
    """Every line of known_hosts is a host key paramiko can use (it skips or crashes on the others)."""
    from paramiko.hostkeys import HostKeyEntry

    try:
        lines = known_hosts.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"fleet file {fleet_path}: cannot read known_hosts {known_hosts}: "
                         f"{getattr(err, 'strerror', None) or err}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            entry = HostKeyEntry.from_line(line, n)
        except Exception:  # paramiko raises several kinds for bad base64, unknown or corrupt keys
            entry = None
        if entry is None:
            raise UsageError(f"known_hosts file {known_hosts} line {n} is not 'HOST KEYTYPE BASE64KEY' with a key "
                             "type paramiko knows; fix or delete that line (ssh-keyscan writes good ones)")


def load_fleet(path: str | Path) -> Fleet:
    """Parse and check fleet.toml (every key typed, unknown keys refused); paths inside are relative to it."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"fleet file not found: {path}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise UsageError(f"fleet file {path} is not valid TOML: {err}") from None
    base = path.parent

    def rel(value: str | None) -> Path | None:
        return None if value is None else (base / value if not Path(value).is_absolute() else Path(value))

    _checked(path, raw, _TOP_KEYS, "")
    if not isinstance(raw.get("hosts", []), list):
        raise UsageError(f"fleet file {path}: hosts must be a list of [[hosts]] tables, not {raw['hosts']!r}")
    hosts: list[Host] = []
    for i, h in enumerate(raw.get("hosts", [])):
        if not isinstance(h, dict):
            raise UsageError(f"fleet file {path}: hosts[{i}] must be a table ([[hosts]] with name and address), not {h!r}")
        if "name" not in h or "address" not in h:
            raise UsageError(f"fleet file {path}: hosts[{i}] needs 'name' and 'address'")
        _checked(path, h, _HOST_KEYS, f"hosts[{i}].")
        twin = next((j for j, other in enumerate(hosts) if other.name == h["name"]), None)
        if twin is not None:
            raise UsageError(f"fleet file {path}: host name {h['name']!r} appears twice (hosts[{twin}] and hosts[{i}])")
        hosts.append(Host(
            name=h["name"], address=h["address"], port=h.get("port", 22), user=h.get("user"),
            key=str(rel(h["key"])) if "key" in h else None, python=h.get("python", "python3"),
            root=h.get("root", raw.get("root", "/opt/edgeq")), device=h.get("device"), tags=tuple(h.get("tags", ())),
        ))
    if not hosts:
        raise UsageError(f"fleet file {path} lists no [[hosts]]")
    tofu = raw.get("trust_on_first_use", False)
    if "known_hosts" not in raw and not tofu:
        raise UsageError(f"fleet file {path} needs known_hosts = 'FILE' (or trust_on_first_use = true)")
    known_hosts = rel(raw.get("known_hosts", "known_hosts"))
    if known_hosts.exists() or not tofu:
        if not known_hosts.exists():
            raise UsageError(f"fleet file {path}: known_hosts file {known_hosts} not found; list the hosts' keys "
                             "there (ssh-keyscan) or set trust_on_first_use = true")
        _check_known_hosts(path, known_hosts)
    public_key = rel(raw.get("public_key"))
    if public_key is not None and not public_key.is_file():
        raise UsageError(f"fleet file {path}: public_key {public_key} is not a file")
    return Fleet(
        path=path, hosts=tuple(hosts), known_hosts=known_hosts, trust_on_first_use=tofu, public_key=public_key,
        connect_timeout=float(raw.get("connect_timeout", 10)), command_timeout=float(raw.get("command_timeout", 600)),
    )


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


class HostFailure(Exception):
    """A step on one host failed; ``str()`` says which and why."""


def _why(err: BaseException) -> str:
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def _plain(text: str, limit: int = 300) -> str:
    """Device output made safe to print: control characters (terminal escapes) shown as escapes, length capped."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_count(text: str | None, total: int, what: str) -> int:
    """``N`` (0 to MAX_HOSTS) or ``P%`` (0 to 100) of ``total``, rounded up."""
    if text is None:
        return 0
    try:
        if str(text).endswith("%"):
            percent = float(str(text)[:-1])
            if not 0 <= percent <= 100:  # nan and inf too
                raise ValueError
            return int(total * percent / 100 + 0.999999)
        value = int(text)
        if not 0 <= value <= MAX_HOSTS:
            raise ValueError
        return value
    except ValueError:
        raise UsageError(f"{what} must be N (0 to {MAX_HOSTS}) or P% (0 to 100%), not {text!r}") from None


# ---------------------------------------------------------------------------------------------------
# one host
# ---------------------------------------------------------------------------------------------------


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
            raise HostFailure(f"{step}: {_plain(text[-1].strip())}") from None
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
            why = _plain(said or failed or f"exit {status}", 120)
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
        result.error = str(err) if isinstance(err, HostFailure) else _plain(f"unexpected {type(err).__name__}: {err}")
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
                         + _plain(", ".join(h.name for h in fleet.hosts)))
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
