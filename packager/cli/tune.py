"""edgeq tune: search schedules on a device over TVM RPC; edgeq package --records uses the result."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from edgeq.cli.package import add_graph_options, front_end_args


def add_parser(sub) -> None:
    parser = sub.add_parser("tune", help="tune schedules on a device over TVM RPC",
                            description="Search schedules for the model's operators on the device behind a TVM RPC "
                                        "tracker (meta_schedule); records go to --records and are reused by "
                                        "'edgeq package --records'. Rerun to resume an interrupted search.")
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--rpc", required=True, metavar="HOST:PORT", help="TVM RPC tracker")
    parser.add_argument("--key", required=True, help="device key registered with the tracker")
    parser.add_argument("--trials", type=int, default=64, help="measurements in all, shared by the tasks, 1 to 100000 (default 64)")
    parser.add_argument("--records", type=Path, default=Path("tuning.json"), help="records file (default tuning.json)")
    add_graph_options(parser)  # the same module as `edgeq package` with these options builds
    parser.add_argument("--timeout", type=float, default=120,
                        help="deadline in seconds for each remote step: reaching the tracker, getting the device, and "
                             "each step of a measurement (upload, load, run); a device that stays unreachable ends "
                             "the search with one line (1 to 86400, default 120, as for bench)")
    parser.add_argument("--jobs", type=int, metavar="N", help="candidates built at once on this host (default: its cores)")
    parser.add_argument("--cost-model", choices=["xgb", "random"], default="xgb",
                        help="what guides the search: meta_schedule's XGBoost model (default) or random guesses")
    parser.add_argument("--json", action="store_true")


def run(args, env) -> int:
    from edgeq.progress import StageProgress
    from edgeq.rpc.tune import TuneArgs, tune

    progress = StageProgress(console=env.err())
    result = tune(TuneArgs(front=front_end_args(args), rpc=args.rpc, key=args.key, trials=args.trials,
                           records=args.records, timeout=args.timeout, jobs=args.jobs, cost_model=args.cost_model),
                  note=progress.note, tick=progress.tick, progress=progress)
    if args.json:
        print(json.dumps(result, indent=2), file=env.stdout)
        return 0
    table = Table(title=Text(f"tuning {result['model']} for {result['device']} -> {result['records']}"))
    for column in ("task", "trials recorded", "best (ms)"):
        table.add_column(column)
    for row in result["tasks"]:
        table.add_row(Text(row["task"]), str(row["trials_recorded"]), f"{row['best_ms']:.4f}" if row["best_ms"] else "-")
    env.out().print(table)
    if result["not_tuned"]:
        env.out().print(Text(f"not tuned (they only move data; edgeq's own schedule): {', '.join(result['not_tuned'])}"))
    counts = result["devices"]["measurements"]
    env.out().print(f"{len(counts)} device(s) took part: " +
                    (", ".join(f"{device or '?'} {n} measurement(s)" for device, n in counts.items()) or "none"))
    from edgeq.rpc.clocks import describe

    for i, state in enumerate(result["devices"].get("states", []), 1):  # the modes and clocks it measured under
        env.out().print(Text(f"device {i}: power mode {describe(state)}"))
    return 0
