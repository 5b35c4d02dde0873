"""edgeq: put ONNX models on NVIDIA Jetson devices with Apache TVM (Relax).

The library is the API; the ``edgeq`` command is a thin adapter over it::

    from edgeq.package import PackageArgs, package
    result = package(PackageArgs(model="model.onnx", device="jetson-orin-nano"))
"""

__version__ = "0.1.0"
