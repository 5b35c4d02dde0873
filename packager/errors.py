"""One exception root for everything edgeq reports to a user.

Only ``edgeq.cli.main`` turns these into a message and an exit status; library code raises them with a
one-line message that names the problem and what to do about it.
"""

from enum import IntEnum


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    MODEL = 3
    DEVICE = 4
    TOOLCHAIN = 5
    OUTPUT = 6
    BUNDLE = 7
    REMOTE = 8
    INTERRUPTED = 130


class EdgeqError(Exception):
    """A problem the user can act on. ``str(err)`` is the one-line message."""

    exit_status = ExitStatus.ERROR


class UsageError(EdgeqError):
    exit_status = ExitStatus.USAGE


class ModelError(EdgeqError):
    """The ONNX model is missing, unreadable, invalid or uses something we cannot compile."""

    exit_status = ExitStatus.MODEL


class DeviceError(EdgeqError):
    """Unknown device profile, or a profile file that does not have the required shape."""

    exit_status = ExitStatus.DEVICE


class ToolchainError(EdgeqError):
    """A compiler, cross compiler or CUDA toolkit the build needs is missing or does not fit."""

    exit_status = ExitStatus.TOOLCHAIN


class OutputError(EdgeqError):
    """The output location cannot be written."""

    exit_status = ExitStatus.OUTPUT


class BundleError(EdgeqError):
    """A bundle is missing, malformed or does not match its manifest."""

    exit_status = ExitStatus.BUNDLE


class RemoteError(EdgeqError):
    """A remote device, tracker or session failed or missed its deadline."""

    exit_status = ExitStatus.REMOTE
