"""edgeq devices: list the device profiles."""

from __future__ import annotations

import json

from rich.table import Table


def add_parser(sub) -> None:
    parser = sub.add_parser("devices", help="list the device profiles", description="List the device profiles edgeq can build for.")
    parser.add_argument("--json", action="store_true", help="print the profiles as JSON")


def run(args, env) -> int:
    from edgeq.targets import profiles

    table = profiles()
    if args.json:
        print(json.dumps([p.to_dict() for p in table.values()], indent=2), file=env.stdout)
        return 0
    view = Table(title="edgeq device profiles")
    for column in ("device", "CPU", "cores", "GPU arch", "CUDA", "JetPack / L4T", "memory", "aliases"):
        view.add_column(column)
    for p in table.values():
        device = p.device_record()  # (what a bundle's manifest says of it)
        view.add_row(
            p.name,
            f"{p.cpu.mcpu} ({p.cpu.arch})",
            str(p.cpu.cores),
            device.cuda_arch or "-",
            device.cuda_version or "-",
            f"{p.software['jetpack']} / {p.software['l4t']}" if "jetpack" in p.software else "-",
            f"{p.memory_mb / 1024:.0f} GiB" if p.memory_mb else "-",
            ", ".join(p.aliases) or "-",
        )
    env.out().print(view)
    return 0
