"""The fleet file (``fleet.toml``): its schema, checked in one pass with one line per problem, and the count
options (``--batch``, ``--canary``, ``--max-failures``: N or P%)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (JetPack 6): the same parser, from PyPI
    import tomli as tomllib

from edgeq.errors import UsageError

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
