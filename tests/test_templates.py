"""Golden tests for the device README, rendered from its template for a Jetson and a host bundle, and the
loader that every bundle ships as it is (templates/run.py).

The manifests under tests/golden are real ones (hashes, times and paths normalised). After an intended
template change, regenerate the READMEs with: EDGEQ_UPDATE_GOLDEN=1 pytest tests/test_templates.py
"""

import json
import os
from pathlib import Path

import pytest

from edgeq.bundle import render, template_context
from edgeq.templates.contract import Manifest

GOLDEN = Path(__file__).parent / "golden"


def _manifest(case: str) -> Manifest:
    return Manifest.from_json(json.loads((GOLDEN / case / "manifest.json").read_text()))


@pytest.mark.parametrize("case", ["orin", "host"])
def test_readme_matches_golden(case):
    rendered = render("README.md.j2", **template_context(_manifest(case)))
    golden = GOLDEN / case / "README.md"
    if os.environ.get("EDGEQ_UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert rendered == golden.read_text()


def test_readme_says_what_the_device_needs():
    orin = (GOLDEN / "orin" / "README.md").read_text()
    assert "sm_87, built with CUDA 12.6 nvrtc" in orin and "CUDA 12.x driver or newer" in orin and "JetPack 6.2" in orin
    host = (GOLDEN / "host" / "README.md").read_text()
    assert "sm_" not in host and "CUDA" not in host
    for readme in (orin, host):  # the loaders' exit statuses, as contract.LoaderExit has them
        assert "4 this machine" in readme and "7 the bundle is damaged" in readme


def test_manifest_round_trips_through_the_contract():
    """What the writer writes is what readers read: to_json(from_json(x)) is x, key order included."""
    for case in ("orin", "host"):
        raw = json.loads((GOLDEN / case / "manifest.json").read_text())
        assert json.dumps(_manifest(case).to_json()) == json.dumps(raw)
