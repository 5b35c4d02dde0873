"""``edgeq.imaging`` is ``templates/imaging.py`` (``edgeq.templates.imaging``), shipped in every bundle: the
packager prepares calibration images with the very functions run.py uses. Both names are the same module."""

import sys

from edgeq.templates import imaging as _module

sys.modules[__name__] = _module
