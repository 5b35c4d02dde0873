"""edgeq bench: latency, throughput and power of a bundle, on a device over TVM RPC or on this machine."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from edgeq.choices import DEFAULT_REPEAT, DEFAULT_WARMUP, POWER_SOURCES


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="measure a bundle's latency and power (remote over TVM RPC, or here)",
                            description="Upload the bundle's library to a device through a TVM RPC tracker, run it, "
                                        "and report latency, throughput and power/energy measured on the device.")
    parser.add_argument("bundle", type=Path, help="bundle directory or .tar.gz")
    parser.add_argument("--rpc", metavar="HOST:PORT", help="TVM RPC tracker (omit to measure on this machine)")
    parser.add_argument("--key", help="device key registered with the tracker")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help=f"timed runs, 1 to 1000000 (default {DEFAULT_REPEAT})")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                        help=f"runs before the timed ones (timed too, shown apart), 0 to 1000000 (default {DEFAULT_WARMUP})")
    parser.add_argument("--power", choices=POWER_SOURCES, default="auto", help="power source on the device")
    parser.add_argument("--power-mode", metavar="NAME|ID",
                        help="Jetson: run in this nvpmodel mode (a name from the device's profile, e.g. MAXN_SUPER, or "
                             "its id) and put the mode back afterwards, also when the run fails; the mode and clocks "
                             "the runs ran under are recorded either way")
    parser.add_argument("--lock-clocks", action="store_true",
                        help="Jetson: lock the clocks at their maximum with jetson_clocks for the run, and restore them")
    parser.add_argument("--timeout", type=float, default=120, help="deadline in seconds for each remote step, 1 to 86400 (default 120)")
    parser.add_argument("--session-timeout", type=float, default=0, help="server-side session limit in seconds, 0 (none) to 86400")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--report", type=Path, metavar="FILE",
                        help="also draw the result: FILE.html (one self-contained page, figures and numbers) or "
                             "FILE.png; latency histogram with p50/p90/p99, every run in order with the warm-up, "
                             "power per rail over time")


def run(args, env) -> int:
    from edgeq.rpc.bench import BenchArgs, bench

    err = env.err()
    if args.report:
        from edgeq.report import check_output

        check_output(args.report)  # before the benchmark: a wrong suffix or folder is known now
    result = bench(BenchArgs(bundle=args.bundle, rpc=args.rpc, key=args.key, repeat=args.repeat, warmup=args.warmup,
                             power=args.power, timeout=args.timeout, session_timeout=args.session_timeout,
                             power_mode=args.power_mode, lock_clocks=args.lock_clocks),
                   note=lambda text: err.print(text, highlight=False, markup=False))
    if args.report:
        from edgeq.report import bench_report, write

        err.print(f"report: {write(bench_report(result), args.report)}", highlight=False, markup=False)
    if args.json:
        print(json.dumps(result, indent=2), file=env.stdout)
        return 0
    table = Table(title=Text(f"{result['bundle_id']} on {result['where']}"), show_header=False)
    for key in ("min_ms", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"):
        table.add_row(key.replace("_ms", " (ms)"), f"{result[key]:.3f}")
    table.add_row("throughput", f"{result['throughput_per_s']:.1f} inferences/s (batch {result['batch']})")
    from edgeq.rpc.clocks import describe

    table.add_row("power mode", Text(describe(result.get("device_state"))))
    power = result["power"]
    if power.get("average_w"):
        table.add_row("power", Text(", ".join(f"{r} {w:.2f} W" for r, w in power["average_w"].items()) +
                                    f" ({power['source']}, {power['samples']} samples)"))
        table.add_row("energy", f"{power['energy_per_inference_mj']:.3f} mJ per inference")
    else:
        table.add_row("power", Text(f"not measured ({power['used']})"))
    env.out().print(table)
    return 0
