"""Entry point: parse argv, call the verb, turn EdgeqError into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import traceback
from typing import TextIO

from rich.console import Console

from edgeq import __version__
from edgeq.errors import EdgeqError, ExitStatus, UsageError

# verb -> "module" or "module:attribute" with add_parser(sub) and run(args, env). A verb module imports only
# light modules at its top (argparse needs its choices for --help); what it runs on is imported in run(), so
# 'edgeq devices' or 'edgeq --version' never loads TVM, ONNX or the compiler.
VERBS = {"devices": "devices", "package": "package", "inspect": "inspect", "keygen": "keygen", "verify": "verify",
         "install": "install", "flash": "flash", "fleet": "flash:FleetVerb", "rollback": "flash:RollbackVerb",
         "mender": "mender",
         "rpc": "rpc", "bench": "bench", "tune": "tune"}


def verb(name: str):
    """The object behind a verb: its module under edgeq.cli, or a class in it."""
    module, _, attribute = VERBS[name].partition(":")
    found = importlib.import_module(f"edgeq.cli.{module}")
    return getattr(found, attribute) if attribute else found


@dataclasses.dataclass
class Environment:
    """The I/O a command uses; tests pass their own streams."""

    stdout: TextIO = dataclasses.field(default_factory=lambda: sys.stdout)
    stderr: TextIO = dataclasses.field(default_factory=lambda: sys.stderr)

    def out(self) -> Console:
        return _console(self.stdout)

    def err(self) -> Console:
        return _console(self.stderr)


def _console(stream: TextIO) -> Console:
    """Rich output; tables get room to breathe when the stream is a file or pipe, not a terminal."""
    width = None if stream.isatty() else 160
    return Console(file=stream, soft_wrap=True, highlight=False, width=width)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgeq", description="Compile, quantize and package ONNX models for NVIDIA Jetson devices.")
    parser.add_argument("--version", action="version", version=f"edgeq {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND", parser_class=_Parser)
    for name in VERBS:
        verb(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None, env: Environment | None = None) -> int:
    env = env or Environment()
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        if args.verb is None:
            raise UsageError("give a command: " + ", ".join(VERBS) + " (see 'edgeq --help')")
        return int(verb(args.verb).run(args, env) or ExitStatus.OK)
    except EdgeqError as err:
        if debug:
            traceback.print_exc(file=env.stderr)
        print(f"edgeq: error: {err}", file=env.stderr)
        return int(err.exit_status)
    except KeyboardInterrupt:
        print("edgeq: interrupted", file=env.stderr)
        return int(ExitStatus.INTERRUPTED)
    except SystemExit as exit_:  # --help / --version
        return int(exit_.code or 0)
    except Exception as err:  # a bug in edgeq or a dependency: say so, keep the traceback behind --debug
        if debug:
            traceback.print_exc(file=env.stderr)
        print(f"edgeq: internal error: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
              " (rerun with --debug for the traceback)", file=env.stderr)
        return int(ExitStatus.ERROR)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
