"""edgeq flash / edgeq fleet status / edgeq rollback: roll bundles out to devices over SSH."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from edgeq.templates.contract import HostState
from edgeq.errors import ExitStatus

if TYPE_CHECKING:
    from edgeq.fleet import HostResult


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "flash", help="roll a bundle out to a fleet over SSH",
        description="Install BUNDLE.tar.gz on every host of the fleet file: verify, unpack, health-check, switch "
                    "atomically, roll back on failure. Canary hosts first; stops when failures exceed --max-failures.")
    parser.add_argument("bundle", type=Path, help="bundle .tar.gz")
    parser.add_argument("--fleet", type=Path, required=True, help="fleet.toml")
    parser.add_argument("--canary", metavar="N|P%", help="hosts in the first wave (tagged 'canary' first)")
    parser.add_argument("--batch", type=int, metavar="N", help="hosts per later wave, 1 or more (default: all the rest)")
    parser.add_argument("--max-failures", default="0", metavar="N|P%", help="stop starting hosts beyond this (default 0)")
    parser.add_argument("--parallel", type=int, default=4, metavar="N", help="hosts at a time, 1 to 256 (default 4)")
    parser.add_argument("--allow-downgrade", action="store_true", help="install an older release than the current one")
    parser.add_argument("--dry-run", action="store_true", help="show the waves; connect to nothing")
    parser.add_argument("--json", action="store_true")


def _printer(env):
    lock = threading.Lock()
    err = env.err()

    def note(text: str) -> None:
        with lock:
            err.print(text, highlight=False, markup=False)  # device text is never read as markup

    return note


def _cells(*values) -> list[Text]:
    """Table cells as plain text: what devices report is never read as rich markup."""
    return [Text("-" if v in (None, "") else str(v)) for v in values]


def report(results: list[HostResult], env, as_json: bool, title: str, extra: dict | None = None,
           bad_states: tuple[HostState, ...] = (HostState.FAILED, HostState.ROLLED_BACK, HostState.SKIPPED)) -> int:
    if as_json:
        print(json.dumps({**(extra or {}), "hosts": [r.to_dict() for r in results]}, indent=2), file=env.stdout)
    else:
        table = Table(title=Text(title))
        for column in ("host", "before", "after", "state", "seconds", "error"):
            table.add_column(column)
        for r in results:
            table.add_row(*_cells(r.host, r.before, r.after, r.state, f"{r.duration_s:.1f}", r.error))
        env.out().print(table)
    bad = [r for r in results if r.state in bad_states]
    return int(ExitStatus.ERROR) if bad and not (extra or {}).get("dry_run") else 0


def run(args, env) -> int:
    from edgeq.fleet import FlashArgs, flash

    flash_args = FlashArgs(bundle=args.bundle, fleet=args.fleet, canary=args.canary, batch=args.batch,
                           max_failures=args.max_failures, parallel=args.parallel, dry_run=args.dry_run,
                           allow_downgrade=args.allow_downgrade)
    results, waves = flash(flash_args, _printer(env))
    summary = {state.value: sum(r.state == state for r in results) for state in HostState}
    return report(results, env, args.json, f"flash {args.bundle.name}: " + ", ".join(f"{n} {s}" for s, n in summary.items() if n),
                  {"bundle": str(args.bundle), "waves": waves, "summary": summary, "dry_run": args.dry_run})


class FleetVerb:
    """edgeq fleet status --fleet FILE"""

    @staticmethod
    def add_parser(sub) -> None:
        parser = sub.add_parser("fleet", help="what each host of a fleet runs", description="Fleet commands.")
        fsub = parser.add_subparsers(dest="fleet_cmd", metavar="status", required=True)
        status = fsub.add_parser("status", help="show the current and previous release of each host")
        status.add_argument("--fleet", type=Path, required=True)
        status.add_argument("--json", action="store_true")

    @staticmethod
    def run(args, env) -> int:
        from edgeq.fleet import fleet_status

        rows = fleet_status(args.fleet)
        if args.json:
            print(json.dumps(rows, indent=2), file=env.stdout)
        else:
            table = Table(title=Text(f"fleet {args.fleet}"))
            for column in ("host", "current", "release", "previous", "error"):
                table.add_column(column)
            for row in rows:
                table.add_row(*_cells(*(row[k] for k in ("host", "current", "release", "previous", "error"))))
            env.out().print(table)
        return int(ExitStatus.ERROR) if any(row["error"] for row in rows) else 0


class RollbackVerb:
    """edgeq rollback --fleet FILE [--host NAME ...]"""

    @staticmethod
    def add_parser(sub) -> None:
        parser = sub.add_parser("rollback", help="return fleet hosts to their previous release",
                                description="Switch hosts back to their previous release and health-check it.")
        parser.add_argument("--fleet", type=Path, required=True)
        parser.add_argument("--host", action="append", metavar="NAME", help="only these hosts (repeatable)")
        parser.add_argument("--json", action="store_true")

    @staticmethod
    def run(args, env) -> int:
        from edgeq.fleet import fleet_rollback

        results = fleet_rollback(args.fleet, args.host, _printer(env))
        return report(results, env, args.json, "rollback", bad_states=(HostState.FAILED,))
