"""The choices and defaults the command line offers, defined once, in a module that imports nothing.

The argument parsers (``edgeq.cli``) read them here without loading the compiler; the library modules that
check them (``edgeq.package``, ``edgeq.quantize``, ``edgeq.runtime.assemble``, ``edgeq.rpc.bench``) import
them from here too. Standard library only: keep it that way, so ``edgeq --help`` never pays for TVM.
"""

from __future__ import annotations

# edgeq package --precision. mixed: int8 with layers returned to float to hold an accuracy budget; fp16: CUDA
# profiles only (fp16 weights and activations, fp32 accumulation)
PRECISIONS = ("fp32", "int8", "mixed", "fp16", "int4")  # int4: language models only (weight-only)
QUANTIZED = ("int8", "mixed")  # the precisions that calibrate (--calibrate DATA)

# edgeq package --runtime; the first is the default. bundled: runtime/ with TVM's runtime, the CUDA bridge and
# edgeq-run; none: the device brings apache-tvm
RUNTIME_CHOICES = ("bundled", "none")

# edgeq package --reference: what a build is checked against before it is written (edgeq.reference); the first
# is the default. auto: ONNX Runtime where installed, else TVM's plain pipeline (int8/mixed: the quantized graph)
REFERENCE_CHOICES = ("auto", "onnxruntime", "tvm")

# edgeq package --calibration: the keys of edgeq.quantize.calibrators.CALIBRATORS, in this order
CALIBRATION_METHODS = ("minmax", "percentile", "entropy", "mse")
DEFAULT_METHOD = "mse"  # chosen by measurement: see README, "Choosing the calibration default"

# edgeq package defaults (PackageArgs, QuantizeArgs and the parser read these)
DEFAULT_OUTPUT = "dist"
DEFAULT_PERCENTILE = 99.99  # --calibration percentile
DEFAULT_CALIB_SAMPLES = 256  # --calib-samples
# --max-answer-loss: past this answer loss (fp32 boxes lost, %; top-1 changed, % of samples; top-1 points lost against
# labels), a plain int8 build warns, or with --strict-accuracy stops (a detector kept 5 of fp32's 10 boxes at cosine 0.9997)
DEFAULT_ANSWER_LOSS_LIMIT = 5.0

# edgeq bench defaults (BenchArgs and the parser)
DEFAULT_REPEAT = 100
DEFAULT_WARMUP = 10

# edgeq bench --power
POWER_SOURCES = ("auto", "tegrastats", "sysfs", "nvml", "none")

__all__ = ["PRECISIONS", "QUANTIZED", "RUNTIME_CHOICES", "REFERENCE_CHOICES", "CALIBRATION_METHODS", "DEFAULT_METHOD", "POWER_SOURCES", "DEFAULT_OUTPUT",
           "DEFAULT_PERCENTILE", "DEFAULT_CALIB_SAMPLES", "DEFAULT_ANSWER_LOSS_LIMIT", "DEFAULT_REPEAT", "DEFAULT_WARMUP"]
