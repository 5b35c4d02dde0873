"""What the quantization passes leave for the report (one object handed to every pass)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class PassNotes:
    float_biases: list[str] = dataclasses.field(default_factory=list)  # fold_bias: biases too large for int32
