"""The device side: everything a bundle carries or a device runs, standard library only.

``run.py`` (the Python loader), ``contract.py`` (the bundle contract, ``edgeq.templates.contract``),
``safebundle.py`` (the verifier and installer, ``edgeq.templates.safebundle``), the device README's jinja2
template, the Mender update module, and ``native/``: the native loader ``edgeq_run.cc`` with its headers
(its ``contract.h`` is generated from ``contract.py`` when it is built) and the CUDA 12 bridge."""
