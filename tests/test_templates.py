"""Golden tests for the rendered templates: the loader and the device README of a Jetson and a host bundle.

After an intended template change, regenerate with: EDGEQ_UPDATE_GOLDEN=1 pytest tests/test_templates.py
"""

import json
import os
from pathlib import Path

import pytest

from edgeq.bundle import render, template_context

GOLDEN = Path(__file__).parent / "golden"
CASES = [(case, template, out) for case in ("orin", "host") for template, out in
         (("run.py.j2", "run.py"), ("README.md.j2", "README.md"))]


@pytest.mark.parametrize("case,template,rendered_name", CASES)
def test_template_matches_golden(case, template, rendered_name):
    manifest = json.loads((GOLDEN / case / "manifest.json").read_text())
    rendered = render(template, **template_context(manifest))
    golden = GOLDEN / case / rendered_name
    if os.environ.get("EDGEQ_UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert rendered == golden.read_text()


def test_rendered_loader_is_valid_python():
    manifest = json.loads((GOLDEN / "orin" / "manifest.json").read_text())
    compile(render("run.py.j2", **template_context(manifest)), "run.py", "exec")


def test_readme_says_what_the_device_needs():
    orin = (GOLDEN / "orin" / "README.md").read_text()
    assert "sm_87, built with CUDA 12.6 nvrtc" in orin and "CUDA 12.x driver or newer" in orin and "JetPack 6.2" in orin
    host = (GOLDEN / "host" / "README.md").read_text()
    assert "sm_" not in host and "CUDA" not in host
