"""The README is a user's document: short, and every edgeq command in it is one the CLI takes as written;
every file it links to exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from edgeq.cli.main import build_parser
from edgeq.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def _commands(text: str) -> list[str]:
    """The ``edgeq ...`` lines of the README's code blocks (indented by 4), continuation lines joined and
    trailing comments dropped."""
    lines, joined = [], ""
    for line in text.splitlines():
        if not line.startswith("    "):
            joined = ""
            continue
        code = line.strip()
        joined = f"{joined} {code}" if joined else code
        if joined.endswith("\\"):
            joined = joined[:-1].rstrip()
            continue
        lines.append(joined)
        joined = ""
    commands = []
    for line in lines:
        if line.startswith("edgeq "):
            commands.append(re.sub(r"\s+#.*$", "", line))
    return commands


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_has_the_two_setup_commands():
    text = README.read_text()
    assert "    bash scripts/quickstart.sh\n" in text and "    bash scripts/test.sh\n" in text


COMMANDS = _commands(README.read_text())


def test_readme_shows_every_job():
    verbs = {shlex.split(c)[1] for c in COMMANDS}
    assert {"package", "bench", "tune", "flash", "mender", "rpc", "keygen", "verify", "inspect", "devices"} <= verbs


@pytest.mark.parametrize("command", COMMANDS)
def test_every_edgeq_command_in_the_readme_parses(command):
    argv = shlex.split(command)[1:]
    try:
        args = build_parser().parse_args(argv)
    except (UsageError, SystemExit) as err:
        pytest.fail(f"README command does not parse: {command}: {err}")
    assert args.verb == argv[0]


def test_every_local_link_in_the_docs_exists():
    for doc in [README, *(REPO / "docs").glob("*.md"), REPO / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which is not there"
