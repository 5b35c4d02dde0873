"""Bounds on what input may make edgeq read, allocate or run, in one place.

Everything sized by a user's or an attacker's input is checked against one of these before it is
allocated; a refusal names the limit and, where it can be raised, the environment variable that raises it.
The bundle-side bounds live in ``safebundle.py`` (it also runs on devices, without edgeq) and in the two
loaders; they are listed here too so that the README table comes from one place.
"""

from __future__ import annotations

import dataclasses
import os

from edgeq.templates import contract, safebundle
from edgeq.errors import UsageError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Limit:
    env: str | None  # None: fixed
    default: int
    what: str

    @property
    def value(self) -> int:
        text = os.environ.get(self.env, "") if self.env else ""
        if not text:
            return self.default
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise UsageError(f"{self.env}={text!r} is not a positive whole number")
        return value

    def exceeded(self, subject: str, amount: int, unit: str = "bytes") -> str:
        """The one-line refusal for ``amount`` over this limit."""
        raise_it = f"; raise {self.env} to allow it" if self.env else ""
        return f"{subject} is {amount:,} {unit}, more than the limit of {self.value:,} ({self.what}){raise_it}"


LIMITS: dict[str, Limit] = {
    "model_bytes": Limit("EDGEQ_MAX_MODEL_BYTES", 2 * GiB, "size of the .onnx file (protobuf's own limit)"),
    "input_bytes": Limit("EDGEQ_MAX_INPUT_BYTES", contract.MAX_INPUT_BYTES, "one model input: golden vectors, run.py / edgeq-run --input"),
    "data_bytes": Limit("EDGEQ_MAX_DATA_BYTES", 8 * GiB, "calibration or evaluation data, all arrays together"),
    "activation_bytes": Limit("EDGEQ_MAX_ACTIVATION_BYTES", 16 * GiB, "any one tensor the model computes"),
    "image_pixels": Limit("EDGEQ_MAX_IMAGE_PIXELS", 50_000_000, "pixels of one calibration image"),
    "json_depth": Limit(None, safebundle.MAX_JSON_DEPTH, "nesting of manifest.json, manifest.sig, state.json, records"),
    "manifest_bytes": Limit(None, safebundle.MAX_MANIFEST_BYTES, "manifest.json"),
    "tar_header_bytes": Limit(None, safebundle.MAX_TAR_HEADER_BYTES, "one PAX / GNU long-name header in an archive"),
    "archive_members": Limit(None, safebundle.MAX_MEMBERS, "members of a bundle archive"),
    "benchmark_runs": Limit(None, 1_000_000, "--benchmark / --warmup / --repeat counts"),
}


def check(name: str, subject: str, amount: int, error=UsageError, unit: str = "bytes") -> None:
    """Raise ``error`` with the limit's one-line refusal when ``amount`` is over limit ``name``."""
    if amount > LIMITS[name].value:
        raise error(LIMITS[name].exceeded(subject, amount, unit))
