"""Entry point: parse argv, call the verb, turn EdgeqError into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import traceback
from typing import TextIO

from rich.console import Console

from edgeq import __version__, native_log
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


# verbs that run TVM's compiler: its C++ log is kept off the terminal unless --debug (edgeq.native_log)
NATIVE_QUIET = {"package", "tune", "mender"}


def main(argv: list[str] | None = None, env: Environment | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    command = next((a for a in argv if not a.startswith("-")), None)
    with native_log.captured(enabled=not debug and command in NATIVE_QUIET) as log:
        env = env or Environment()
        status, internal = _run(argv, env, debug)
        if internal and log is not None and log.lines():  # a bug: what TVM said last may be its cause
            print(f"edgeq: TVM's log ended with: {log.lines()[-1][:300]} (--debug shows all of it)", file=env.stderr)
        return status


def _run(argv: list[str], env: Environment, debug: bool) -> tuple[int, bool]:
    """(exit status, whether it is an internal error)."""
    try:
        args = build_parser().parse_args(argv)
        if args.verb is None:
            raise UsageError("give a command: " + ", ".join(VERBS) + " (see 'edgeq --help')")
        return int(verb(args.verb).run(args, env) or ExitStatus.OK), False
    except EdgeqError as err:
        if debug:
            traceback.print_exc(file=env.stderr)
        print(f"edgeq: error: {err}", file=env.stderr)
        return int(err.exit_status), False
    except KeyboardInterrupt:
        print("edgeq: interrupted", file=env.stderr)
        return int(ExitStatus.INTERRUPTED), False
    except SystemExit as exit_:  # --help / --version
        return int(exit_.code or 0), False
    except Exception as err:  # a bug in edgeq or a dependency: say so, keep the traceback behind --debug
        if debug:
            traceback.print_exc(file=env.stderr)
        print(f"edgeq: internal error: {type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
              " (rerun with --debug for the traceback)", file=env.stderr)
        return int(ExitStatus.ERROR), True


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
