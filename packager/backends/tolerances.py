"""The self-test's tolerances (``Backend.golden_tolerance`` picks among them; ``edgeq.package`` reuses the fp16
and int8 ones for the reference check)."""

# The self-test's tolerances: golden outputs are computed on the build host; the device may use other
# kernels (CUDA, fast math).
GOLDEN_RTOL, GOLDEN_ATOL = 1e-3, 1e-4
# fp16: the device's sums (tensor cores, another order) round to fp16 after each layer where the host's may not
GOLDEN_FP16_RTOL, GOLDEN_FP16_ATOL = 2e-2, 5e-3
# int8 built for another machine than the one computing the golden outputs: a float difference of an ulp
# before a quantize (another summation order, FMA contraction) moves a value across a rounding boundary,
# one quantization step, and the layers after carry it. Measured on an H200 against the host golden: ResNet-18
# int8 max |diff| 0.067 on logits up to 10.8 (0.6%), the same with and without tensor cores; MobileNetV2 int8
# 0.016 on logits up to 1.14 (1.4%). atol is 5% of the output range: a wrong kernel misses by far more.
GOLDEN_INT8_RTOL, GOLDEN_INT8_ATOL = 2e-2, 5e-2
