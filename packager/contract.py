"""``edgeq.contract`` is ``templates/contract.py`` (``edgeq.templates.contract``): the device side lives under templates/, and
this name stays for edgeq's modules and users' code. Both names are the same module object."""

import sys

from edgeq.templates import contract as _module

sys.modules[__name__] = _module
