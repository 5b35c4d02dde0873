"""edgeq package: parse the arguments and call ``edgeq.package.package``."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from edgeq.load import parse_shape
from edgeq.package import PRECISIONS, PackageArgs, package
from edgeq.progress import StageProgress


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "package",
        help="compile an ONNX model into a runtime bundle for a device",
        description="Compile an ONNX model for a device and write OUTDIR/<name>-<device>/ and its .tar.gz.",
    )
    parser.add_argument("model", type=Path, help="the ONNX model")
    parser.add_argument("--device", required=True, help="device profile or alias (see 'edgeq devices')")
    parser.add_argument("-o", "--output", type=Path, default=Path("dist"), help="output folder (default: dist)")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x224x224",
                        help="fix the shape of an input with dynamic dims; repeat per input")
    parser.add_argument("--name", help="bundle name (default: the model file's name)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="numeric precision (default: fp32)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def run(args, env) -> int:
    shapes = dict(parse_shape(text) for text in args.input_shape)
    package_args = PackageArgs(
        model=args.model,
        device=args.device,
        output=args.output,
        input_shapes=shapes,
        name=args.name,
        precision=args.precision,
    )
    progress = StageProgress(console=env.err(), quiet=args.quiet)
    result = package(package_args, progress)
    progress.note(f"done: {result.bundle_dir} and {result.archive.name} in {result.total_seconds:.1f} s")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2), file=env.stdout)
        return 0
    view = Table(title=f"bundle {result.manifest['bundle_id']}", show_header=False)
    toolkit = result.manifest["toolchain"]["cuda_toolkit"]
    rows = [
        ("bundle", str(result.bundle_dir)),
        ("archive", str(result.archive)),
        ("device", result.device),
        ("precision", result.precision),
        ("CUDA", f"{result.manifest['device']['cuda_arch']}, CUDA {toolkit['version']} {toolkit['kind']}" if toolkit else "-"),
        *((f"time: {name}", f"{seconds:.2f} s") for name, seconds in result.stages.items()),
        ("time: total", f"{result.total_seconds:.2f} s"),
    ]
    for key, value in rows:
        view.add_row(key, value)
    env.out().print(view)
    return 0
