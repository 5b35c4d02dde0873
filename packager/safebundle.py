"""``edgeq.safebundle`` is ``templates/safebundle.py`` (``edgeq.templates.safebundle``): the device side lives under templates/, and
this name stays for edgeq's modules and users' code. Both names are the same module object."""

import sys

from edgeq.templates import safebundle as _module

sys.modules[__name__] = _module
