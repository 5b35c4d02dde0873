"""The set-up scripts never mix interpreters: everything they run comes from .venv (or .venv-export for the
torch export), never a python, pip or edgeq that happens to be on PATH; and they are valid bash."""

import re
import subprocess

import pytest

from conftest import REPO

SCRIPTS = sorted((REPO / "scripts").glob("*.sh")) + [REPO / ".ci" / "run"]
BARE = re.compile(r"(^|[;&|(]\s*|\$\(\s*)(python3?(\.\d+)?|pip3?|edgeq|pytest)\b(?!=)")


def commands(path):
    """The script's lines without comments and quoted text (what is run, not what is said)."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = re.sub(r"#.*", "", re.sub(r'"[^"]*"|\'[^\']*\'', '""', line)).strip()
        if code:
            yield number, code


@pytest.mark.parametrize("script", SCRIPTS + sorted((REPO / "benchmarks").glob("*.sh")), ids=lambda p: p.name)
def test_script_is_valid_bash(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_no_interpreter_from_path(script):
    bare = [f"{script.name}:{n}: {code}" for n, code in commands(script) if BARE.search(code)]
    assert not bare, "\n".join(bare)


def test_scripts_use_the_venv():
    quickstart = (REPO / "scripts" / "quickstart.sh").read_text()
    assert "py=.venv/bin/python" in quickstart and "edgeq=.venv/bin/edgeq" in quickstart
    assert "exec .venv/bin/python -m pytest" in (REPO / "scripts" / "test.sh").read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert '"$PY" -m pip install' in setup and 'PY="$VENV/bin/python"' in setup and "VENV=.venv" in setup
