"""The CUDA path from the build alone: per model and precision, what a jetson-orin-nano bundle runs per inference.

    python benchmarks/gpu_kernels.py [--models resnet18 mobilenet_v2] [--precisions fp32 fp16 int8] [--json]
    python benchmarks/gpu_kernels.py --onnx resnet18=zoo/resnet18-224.onnx   # a real export instead of the builder
    python benchmarks/gpu_kernels.py --precisions fp16 --gpu-kernels cutlass   # convolutions on CUTLASS (#42)
    python benchmarks/gpu_kernels.py --models resnet50 --batch 8 --precisions fp16 int8 --gpu-kernels cutlass

For each bundle (``edgeq package``, runtime none): kernel launches per inference and whether CUDA graph capture
took effect (``library.gpu_kernels``), the conv/matmul kernels and how many of them run on tensor cores (their
SASS, cut out of model.so and disassembled with cuobjdump, has HMMA for fp16 or IMMA for int8), the kernels
still on dlight's "fallback" rule, the tensor-core schedules that fell back, and the bytes of weights. No GPU
is needed. The models are written with the onnx helper (random weights, BatchNorm after every conv, as an
exporter that does not fold it writes them): ResNet-18, ResNet-50, MobileNetV2 and EfficientNet-B0 at 224x224, a
YOLOv8n-style detector at 640x640 and a BERT-style encoder (all-MiniLM-L6-v2's shape, 128 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEVICE = "jetson-orin-nano"
TENSOR_CORE_SASS = {"fp16": "HMMA", "int8": "IMMA"}


# ------------------------------------------------------------------ models (onnx helper)


class Net:
    """An ONNX graph written with onnx.helper: conv-BatchNorm layers, activations, residual adds."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, prefix: str, array) -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, bias: bool = False) -> str:
        w = self.const("w", self.rng.standard_normal((cout, cin // groups, k, k)) / np.sqrt(cin // groups * k * k))
        b = [self.const("b", self.rng.standard_normal(cout) * 0.1)] if bias else []
        y = self.node("Conv", [x, w, *b], kernel_shape=[k, k], strides=[stride] * 2, pads=[k // 2] * 4, group=groups)
        stats = [self.rng.uniform(0.5, 1.5, cout), self.rng.standard_normal(cout) * 0.1,
                 self.rng.standard_normal(cout) * 0.1, self.rng.uniform(0.5, 1.5, cout)]
        return self.node("BatchNormalization", [y, *(self.const(p, s) for p, s in zip(("g", "be", "m", "v"), stats))],
                         epsilon=1e-5)

    def relu6(self, x: str) -> str:
        return self.node("Clip", [x, self.const("lo", 0.0), self.const("hi", 6.0)])

    def classifier(self, x: str, cin: int, classes: int) -> None:
        flat = self.node("Flatten", [self.node("GlobalAveragePool", [x])], axis=1)
        fc = [self.const("fcw", self.rng.standard_normal((classes, cin)) / np.sqrt(cin)),
              self.const("fcb", self.rng.standard_normal(classes) * 0.1)]
        self.nodes.append(helper.make_node("Gemm", [flat, *fc], ["logits"], transB=1))

    def save(self, path: Path, size: int, classes: int, batch: int = 1, input_shape: list | None = None,
             output: tuple[str, list] | None = None) -> Path:
        """The graph as an ONNX file: input ``input`` [batch, 3, size, size] (or ``input_shape``), output ``logits``
        [batch, classes] (or ``output``: name and shape)."""
        out_name, out_shape = output or ("logits", [batch, classes])
        graph = helper.make_graph(self.nodes, path.stem,
                                  [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                 input_shape or [batch, 3, size, size])],
                                  [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, out_shape)],
                                  self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx.helper")
        model.ir_version = 8
        onnx.checker.check_model(model)
        onnx.save(model, path)
        return path


def resnet18(path: Path, size: int = 224, classes: int = 1000, batch: int = 1) -> Path:
    """ResNet-18 (torchvision's layout: 7x7/2 stem, max pool, 4 stages of 2 basic blocks), BatchNorm after every conv."""
    net = Net(18)
    x = net.node("Relu", [net.conv_bn("input", 3, 64, 7, 2)])
    x = net.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            y = net.conv_bn(net.node("Relu", [net.conv_bn(x, cin, cout, 3, stride)]), cout, cout, 3)
            short = x if stride == 1 and cin == cout else net.conv_bn(x, cin, cout, 1, stride)
            x = net.node("Relu", [net.node("Add", [y, short])])
            cin = cout
    net.classifier(x, cin, classes)
    return net.save(path, size, classes, batch)


def resnet50(path: Path, size: int = 224, classes: int = 1000, batch: int = 1) -> Path:
    """ResNet-50 (torchvision's layout: 7x7/2 stem, max pool, 3-4-6-3 bottleneck blocks, stride on the 3x3),
    BatchNorm after every conv."""
    net = Net(50)
    x = net.node("Relu", [net.conv_bn("input", 3, 64, 7, 2)])
    x = net.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for block in range(blocks):
            stride = 2 if stage and not block else 1
            y = net.node("Relu", [net.conv_bn(x, cin, width, 1)])
            y = net.node("Relu", [net.conv_bn(y, width, width, 3, stride)])
            y = net.conv_bn(y, width, width * 4, 1)
            short = x if stride == 1 and cin == width * 4 else net.conv_bn(x, cin, width * 4, 1, stride)
            x = net.node("Relu", [net.node("Add", [y, short])])
            cin = width * 4
    net.classifier(x, cin, classes)
    return net.save(path, size, classes, batch)


# torchvision's MobileNetV2: (expansion, channels, repeats, first stride)
MOBILENET_V2 = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def mobilenet_v2(path: Path, size: int = 224, classes: int = 1000, settings=MOBILENET_V2, last: int = 1280,
                 batch: int = 1) -> Path:
    """MobileNetV2: inverted residual blocks (1x1 expand, 3x3 depthwise, 1x1 project; ReLU6, residual add
    where the shape allows), BatchNorm after every conv."""
    net = Net(2)
    x = net.relu6(net.conv_bn("input", 3, 32, 3, 2))
    cin = 32
    for t, c, n, s in settings:
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * t
            y = net.relu6(net.conv_bn(x, cin, hidden, 1)) if t != 1 else x
            y = net.relu6(net.conv_bn(y, hidden, hidden, 3, stride, groups=hidden))
            y = net.conv_bn(y, hidden, c, 1)
            x = net.node("Add", [x, y]) if stride == 1 and cin == c else y
            cin = c
    x = net.relu6(net.conv_bn(x, cin, last, 1))
    net.classifier(x, last, classes)
    return net.save(path, size, classes, batch)


# torchvision's EfficientNet-B0: (expansion, kernel, first stride, channels, repeats)
EFFICIENTNET_B0 = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
                   (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))


def efficientnet_b0(path: Path, size: int = 224, classes: int = 1000, batch: int = 1, settings=EFFICIENTNET_B0,
                    last: int = 1280, gate: str = "Sigmoid") -> Path:
    """EfficientNet-B0 (torchvision's layout): MBConv blocks (1x1 expand, depthwise kxk, squeeze-and-excitation with
    a quarter of the block's input channels, 1x1 project, residual add where the shape allows), SiLU as Sigmoid and
    Mul, BatchNorm after every conv but the excitation's (which have biases). ``gate="HardSigmoid"``: the
    excitation's gate as MobileNetV3's (``relu6(x + 3) / 6``)."""
    net = Net(3)

    def silu(x):
        return net.node("Mul", [x, net.node("Sigmoid", [x])])

    def conv(x, cin, cout, k, stride=1, groups=1, bias=False, bn=True):
        if bn:
            return net.conv_bn(x, cin, cout, k, stride, groups)
        w = net.const("w", net.rng.standard_normal((cout, cin // groups, k, k)) / np.sqrt(cin // groups * k * k))
        b = net.const("b", net.rng.standard_normal(cout) * 0.1)
        return net.node("Conv", [x, w, b], kernel_shape=[k, k], pads=[k // 2] * 4)

    x = silu(conv("input", 3, 32, 3, 2))
    cin = 32
    for t, k, s, c, n in settings:
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * t
            y = silu(conv(x, cin, hidden, 1)) if t != 1 else x
            y = silu(conv(y, hidden, hidden, k, stride, groups=hidden))
            squeeze = max(1, cin // 4)
            e = net.node("GlobalAveragePool", [y])
            e = conv(silu(conv(e, hidden, squeeze, 1, bn=False)), squeeze, hidden, 1, bn=False)
            e = net.node(gate, [e], **({"alpha": 1 / 6, "beta": 0.5} if gate == "HardSigmoid" else {}))
            y = conv(net.node("Mul", [y, e]), hidden, c, 1)
            x = net.node("Add", [x, y]) if stride == 1 and cin == c else y
            cin = c
    x = silu(conv(x, cin, last, 1))
    net.classifier(x, last, classes)
    return net.save(path, size, classes, batch)


def yolov8n(path: Path, size: int = 640, classes: int = 80, batch: int = 1) -> Path:
    """A YOLOv8n-style detector as Ultralytics' exporter writes its layers (conv-BatchNorm-SiLU with SiLU as Sigmoid
    and Mul; BatchNorm left unfolded as the other builders): the n-scale backbone (3x3/2 convs, C2f blocks with
    residual bottlenecks, SPPF's three 5x5 max pools), the PAN neck (nearest 2x upsampling, concatenations, C2f
    without shortcuts, 3x3/2 convs) and the anchor-free head (per level a box branch of 3x3, 3x3, 1x1 to 64 and a
    class branch to ``classes``), the three levels' outputs flattened and concatenated, [batch, 64 + classes,
    anchors]. The box decoding (DFL, a softmax over 16 bins and a 1x1 conv) is left out: no conv/matmul FLOPs."""
    net = Net(8)

    def conv(x, cin, cout, k=1, stride=1):
        y = net.conv_bn(x, cin, cout, k, stride)
        return net.node("Mul", [y, net.node("Sigmoid", [y])])

    def c2f(x, cin, cout, n, shortcut):
        c = cout // 2
        y = conv(x, cin, 2 * c)
        parts = [net.name("split"), net.name("split")]
        sizes = net.name("sizes")
        net.inits.append(numpy_helper.from_array(np.array([c, c], np.int64), sizes))
        net.nodes.append(helper.make_node("Split", [y, sizes], parts, axis=1))
        for _ in range(n):
            b = conv(conv(parts[-1], c, c, 3), c, c, 3)
            parts.append(net.node("Add", [parts[-1], b]) if shortcut else b)
        return conv(net.node("Concat", parts, axis=1), (2 + n) * c, cout)

    def up(x):
        scales = net.const("scales", [1.0, 1.0, 2.0, 2.0])
        return net.node("Resize", [x, "", scales], mode="nearest")

    x = conv(conv("input", 3, 16, 3, 2), 16, 32, 3, 2)
    x = c2f(x, 32, 32, 1, True)
    p3 = c2f(conv(x, 32, 64, 3, 2), 64, 64, 2, True)
    p4 = c2f(conv(p3, 64, 128, 3, 2), 128, 128, 2, True)
    x = c2f(conv(p4, 128, 256, 3, 2), 256, 256, 1, True)
    y = conv(x, 256, 128)  # SPPF
    pools = [y]
    for _ in range(3):
        pools.append(net.node("MaxPool", [pools[-1]], kernel_shape=[5, 5], strides=[1, 1], pads=[2, 2, 2, 2]))
    p5 = conv(net.node("Concat", pools, axis=1), 512, 256)
    h4 = c2f(net.node("Concat", [up(p5), p4], axis=1), 384, 128, 1, False)
    o3 = c2f(net.node("Concat", [up(h4), p3], axis=1), 192, 64, 1, False)
    o4 = c2f(net.node("Concat", [conv(o3, 64, 64, 3, 2), h4], axis=1), 192, 128, 1, False)
    o5 = c2f(net.node("Concat", [conv(o4, 128, 128, 3, 2), p5], axis=1), 384, 256, 1, False)
    outs = []
    flat = net.name("flat")
    net.inits.append(numpy_helper.from_array(np.array([batch, 64 + classes, -1], np.int64), flat))
    for level, c in ((o3, 64), (o4, 128), (o5, 256)):
        box = conv(conv(level, c, 64, 3), 64, 64, 3)
        box = net.node("Conv", [box, net.const("w", net.rng.standard_normal((64, 64, 1, 1)) / 8),
                                net.const("b", net.rng.standard_normal(64) * 0.1)], kernel_shape=[1, 1])
        c3 = max(c, min(classes, 100))
        cls = conv(conv(level, c, c3, 3), c3, c3, 3)
        cls = net.node("Conv", [cls, net.const("w", net.rng.standard_normal((classes, c3, 1, 1)) / np.sqrt(c3)),
                                net.const("b", net.rng.standard_normal(classes) * 0.1)], kernel_shape=[1, 1])
        outs.append(net.node("Reshape", [net.node("Concat", [box, cls], axis=1), flat]))
    net.nodes.append(helper.make_node("Concat", outs, ["output"], axis=2))
    anchors = sum((size // s) ** 2 for s in (8, 16, 32))
    return net.save(path, size, classes, batch, output=("output", [batch, 64 + classes, anchors]))


def bert_encoder(path: Path, seq: int = 128, hidden: int = 384, heads: int = 12, layers: int = 6, ffn: int = 4,
                 batch: int = 1) -> Path:
    """A BERT-style encoder as PyTorch's exporter writes one (all-MiniLM-L6-v2's shape by default: 6 layers, hidden
    384, 12 heads, FFN 1536, 128 tokens): per layer Q/K/V projections (MatMul + Add), heads split by Reshape and
    Transpose, scaled QK^T, Softmax, times V, the output projection, residual Add and LayerNormalization, then the
    FFN with GELU (the Erf form) and a second residual and LayerNormalization. Input: hidden states [batch, seq,
    hidden] (the embeddings' lookup is not a GPU kernel of interest)."""
    net = Net(7)
    dh = hidden // heads

    def shape(name, dims):
        net.inits.append(numpy_helper.from_array(np.array(dims, np.int64), name))
        return name

    def linear(x, cin, cout):
        w = net.const("w", net.rng.standard_normal((cin, cout)) / np.sqrt(cin))
        return net.node("Add", [net.node("MatMul", [x, w]), net.const("b", net.rng.standard_normal(cout) * 0.1)])

    def layer_norm(x):
        return net.node("LayerNormalization", [x, net.const("g", net.rng.uniform(0.5, 1.5, hidden)),
                                               net.const("be", net.rng.standard_normal(hidden) * 0.1)],
                        axis=-1, epsilon=1e-12)

    split, merge = shape("split", [batch, seq, heads, dh]), shape("merge", [batch, seq, hidden])
    x = "input"
    for _ in range(layers):
        q, k, v = (net.node("Transpose", [net.node("Reshape", [linear(x, hidden, hidden), split])], perm=perm)
                   for perm in ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3]))
        scores = net.node("Mul", [net.node("MatMul", [q, k]), net.const("c", 1 / np.sqrt(dh))])
        context = net.node("MatMul", [net.node("Softmax", [scores], axis=-1), v])
        context = net.node("Reshape", [net.node("Transpose", [context], perm=[0, 2, 1, 3]), merge])
        x = layer_norm(net.node("Add", [x, linear(context, hidden, hidden)]))
        h = linear(x, hidden, hidden * ffn)
        erf = net.node("Erf", [net.node("Mul", [h, net.const("r2", 1 / np.sqrt(2))])])
        h = net.node("Mul", [net.node("Mul", [h, net.const("half", 0.5)]),
                             net.node("Add", [net.const("one", 1.0), erf])])
        x = layer_norm(net.node("Add", [x, linear(h, hidden * ffn, hidden)]))
    net.nodes.append(helper.make_node("Identity", [x], ["hidden"]))
    return net.save(path, seq, hidden, batch, input_shape=[batch, seq, hidden],
                    output=("hidden", [batch, seq, hidden]))


MODELS = {"resnet18": resnet18, "resnet50": resnet50, "mobilenet_v2": mobilenet_v2, "efficientnet_b0": efficientnet_b0,
          "yolov8n": yolov8n, "bert_encoder": bert_encoder}


# ------------------------------------------------------------------ measuring a bundle

from edgeq.backends.cuda.cubin import cuda_tool  # noqa: E402




def sass_by_kernel(library: Path) -> dict[str, str]:
    """Kernel symbol -> its SASS, for every CUDA image in ``library``."""
    from edgeq.backends.cuda.cubin import cuda_images

    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = {**os.environ, "PATH": f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, image in enumerate(cuda_images(library)):
            cubin = Path(tmp, f"{i}.cubin")
            cubin.write_bytes(image.data)
            text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env,
                                  check=True).stdout
            for part in text.split("Function : ")[1:]:
                name, _, body = part.partition("\n")
                out[name.strip()] = body
    return out


def kernel_sass(function: str, sass: dict[str, str]) -> str:
    """The SASS of a TVM PrimFunc's kernels (``<function>_kernel``, ``<function>_kernel_1``, ...)."""
    pattern = re.compile(rf"{re.escape(function)}_kernel(_?\d+)?")
    return "".join(body for name, body in sass.items() if pattern.fullmatch(name))


def is_gemm(function: str) -> bool:
    """A conv/matmul kernel (FuseOps names a fused function after its operators; CUTLASS's are cutlass_*, edgeq's
    depthwise kernels depthwise_*, its global pool + classifier kernels poolfc_*, its squeeze-and-excitation kernels
    se_*, its attention scores + softmax kernels attn_*)."""
    return function.startswith(("cutlass_", "depthwise_", "poolfc_", "se_", "attn_")) or any(
        op in function for op in ("conv2d", "matmul", "dense"))


def model_flops(model: Path) -> int:
    """The conv/matmul FLOPs of one inference of an ONNX model (2 per multiply-add), from its inferred shapes."""
    m = onnx.shape_inference.infer_shapes(onnx.load(str(model)))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*m.graph.value_info, *m.graph.input, *m.graph.output]}
    shapes.update({t.name: list(t.dims) for t in m.graph.initializer})
    total = 0
    for node in m.graph.node:
        if node.op_type == "Conv":
            w, out = shapes[node.input[1]], shapes[node.output[0]]
            total += 2 * int(np.prod(out)) * int(np.prod(w[1:]))
        elif node.op_type in ("MatMul", "Gemm"):
            a, out = shapes[node.input[0]], shapes[node.output[0]]
            trans_a = any(at.name == "transA" and at.i for at in node.attribute)
            total += 2 * int(np.prod(out)) * (a[-2] if trans_a else a[-1])
    return total


def measure(bundle_dir: Path, precision: str) -> dict:
    """What one bundle runs: see the module docstring."""
    manifest = json.loads(Path(bundle_dir, "manifest.json").read_text())
    kernels = manifest["library"]["gpu_kernels"]
    sass = sass_by_kernel(Path(bundle_dir, "model.so"))
    gemms = sorted(f for f in kernels["functions"] if is_gemm(f))
    instruction = TENSOR_CORE_SASS.get(precision)
    # an int8 bundle's fp16 kernels (attention's batched GEMMs on the CUTLASS path) are on tensor cores too
    accepted = {"fp16": "HMMA", "int8": "IMMA|HMMA"}.get(precision)
    tensor_cores = sorted(f for f in gemms if accepted and re.search(rf"\b({accepted})\.", kernel_sass(f, sass)))
    launches = kernels["launches"]  # a PrimFunc runs as often as main calls it (same shapes: one function)
    return {
        "precision": precision,
        "kernels_per_inference": kernels["kernels_per_inference"],
        "cuda_graph": kernels["cuda_graph"],
        "cuda_graph_kernels": kernels["cuda_graph_kernels"],
        "conv_matmul_launches": sum(launches.get(f, 0) for f in gemms),
        "tensor_core_launches": sum(launches.get(f, 0) for f in tensor_cores),
        "conv_matmul_kernels": len(gemms),  # distinct functions
        "tensor_core_kernels": len(tensor_cores),
        "tensor_core_instruction": instruction,
        "gemm_without_tensor_cores": [f for f in gemms if f not in tensor_cores],
        "on_fallback_rule": sorted(f for f in gemms if kernels["functions"][f] == "fallback"),
        # tensor-core schedules that did not build: retried without software pipeline (and built), or fell back
        "pipeline_retries": sorted({f["function"] for f in kernels["fallbacks"]
                                    if "tensorized" in kernels["functions"].get(f["function"], "")}),
        "tensor_core_fallbacks": sorted({f["function"] for f in kernels["fallbacks"] if "tensorized" in f["rule"]
                                         and "tensorized" not in kernels["functions"].get(f["function"], "")}),
        "fallbacks": kernels["fallbacks"],
        "schedules": kernels["schedules"],
        "weight_bytes": manifest["weights"]["bytes"],
        "weight_dtypes": manifest["weights"]["dtypes"],
        "manifest_precision": manifest["precision"],
        "cutlass": _cutlass_part(kernels.get("cutlass"), sass, instruction),
    }


def _cutlass_part(record: dict | None, sass: dict[str, str], instruction: str | None) -> dict | None:
    """--gpu-kernels cutlass: its kernels' FLOPs on tensor cores (their SASS has the instruction), and what it left."""
    if record is None:
        return None
    # each kernel by its own precision: an int8 bundle's attention GEMMs are fp16 (HMMA)
    on_tensor_cores = [k for k in record["kernels"] if instruction and re.search(
        rf"\b{TENSOR_CORE_SASS.get(k['precision'], instruction)}\.", kernel_sass(k["function"], sass))]
    return {"kernels": len(record["kernels"]), "on_tensor_cores": len(on_tensor_cores),
            "flops": sum(k["flops"] for k in on_tensor_cores), "depthwise": len(record.get("depthwise", [])),
            "depthwise_flops": sum(k["flops"] for k in record.get("depthwise", [])), "left": record["left"]}


def package_and_measure(model: Path, precision: str, out: Path, calib: Path | None = None,
                        gpu_kernels: str = "dlight") -> dict:
    """``edgeq package`` for jetson-orin-nano in ``precision`` (int8: minmax calibration on ``calib``), measured."""
    from edgeq.package import PackageArgs, package
    from edgeq.quantize import QuantizeArgs

    quantize = None
    if precision in ("int8", "mixed"):
        quantize = QuantizeArgs(calibrate=calib, method="minmax", samples=4)
    folder = out / (precision if gpu_kernels == "dlight" else f"{precision}-{gpu_kernels}")
    result = package(PackageArgs(model=model, device=DEVICE, output=folder,
                                 precision=precision, quantize=quantize, runtime="none", gpu_kernels=gpu_kernels))
    row = measure(result.bundle_dir, precision)
    row["orin_estimate"] = orin_estimate(json.loads(Path(result.bundle_dir, "manifest.json").read_text()))
    if row["cutlass"] is not None:
        total = model_flops(model)
        row["cutlass"]["model_flops"] = total
        row["cutlass"]["tensor_core_flops_share"] = round(row["cutlass"]["flops"] / total, 4) if total else None
    return {**row, "gpu_kernels": gpu_kernels}


# an Ampere SM's CUDA cores (the Orin's GA10B as the GA10x whitepaper's SM: 128 FP32 lanes, 64 INT32 lanes), a
# multiply-add counted as 2 operations: what edgeq's depthwise kernels run on
SIMT_FP32_OPS_PER_CLOCK_PER_SM = 256
SIMT_INT32_OPS_PER_CLOCK_PER_SM = 128
LAUNCH_US = 3.0  # what a kernel costs beyond its roofline time inside a CUDA graph (an estimate's assumption)


def orin_estimate(manifest: dict, device: str = DEVICE) -> dict | None:
    """The roofline time of one inference on the profile's GPU (jetson-orin-nano: the Orin Nano 8GB at MAXN_SUPER,
    numbers and sources in its targets/*.toml): each CUTLASS kernel (and edgeq's depthwise kernels, at the CUDA cores'
    rate) at max(FLOPs / (peak x wave efficiency),
    bytes / bandwidth), its CTAs against the SMs (blocks per SM by shared memory and threads), edgeq's other kernels
    (pooled classifiers, squeeze-and-excitations, attention scores, layer norms, per-token quantizes) by their bytes
    and work, plus LAUNCH_US for every kernel launch in the CUDA graph; the kernels left to TVM are counted by that
    launch cost only (element-wise and pooling kernels move little; a conv/matmul left to dlight is listed). An
    estimate, not a measurement."""
    from edgeq.targets import resolve

    spec = resolve(device)[0].cuda
    gpu = manifest["library"]["gpu_kernels"]
    record = gpu.get("cutlass")
    if record is None or not spec.clock_mhz:
        return None
    clock = spec.clock_mhz * 1e6
    kernels, total_us = [], 0.0

    def row(k, bytes_, ctas, per_sm, waves, efficiency, compute_us) -> float:
        """One kernel's row: the larger of its compute and its memory time (returned, in us)."""
        memory_us = bytes_ / (spec.memory_bandwidth_gbs * 1e9) * 1e6
        us = max(compute_us, memory_us)
        kernels.append({"function": k["function"], "flops": k.get("flops", 0), "bytes": int(bytes_), "ctas": ctas,
                        "ctas_per_sm": per_sm, "waves": waves, "wave_efficiency": efficiency,
                        "compute_us": round(compute_us, 2), "memory_us": round(memory_us, 2), "us": round(us, 2),
                        "bound": "compute" if compute_us >= memory_us else "memory"})
        return us
    for k in record["kernels"] + record.get("depthwise", []):
        int8 = k["precision"] == "int8"
        if k["template"].startswith("edgeq depthwise"):  # CUDA cores, not tensor cores
            per_sm = SIMT_INT32_OPS_PER_CLOCK_PER_SM if int8 else SIMT_FP32_OPS_PER_CLOCK_PER_SM
        else:
            per_sm = spec.int8_ops_per_clock_per_sm if int8 else spec.fp16_ops_per_clock_per_sm
        peak = per_sm * spec.sm_count * clock
        elem = 1 if int8 else 2
        if "mnk" in k["problem"]:  # a batched GEMM (attention): a, w and y once per batch
            batch, (m, nn, kk) = k["problem"]["batch"], k["problem"]["mnk"]
            bytes_ = batch * (m * kk + kk * nn + m * nn) * elem
        else:
            n, h, w, c = k["problem"]["nhwc"]
            (r, s_), kk = k["problem"]["rs"], k["problem"]["k"]
            out_elem = 4 if (k.get("requantize") or {}).get("float_out") else \
                {"float32": 4, "float16": 2, "int8": 1}.get(k.get("output"), elem)
            m = k["problem"]["output_pixels"]
            per_filter = c // k["problem"].get("groups", 1)
            written = m * kk * out_elem
            if "detector_output" in k["problem"]:  # only the model's output, in its dtype
                written = m * kk * {"float32": 4, "float16": 2}[k["problem"]["detector_output"]["dtype"]]
            if "upsampled_2x_into_channels" in k["problem"]:  # and at the four pixels each becomes
                written *= 5
            bytes_ = n * h * w * c * elem + kk * r * s_ * per_filter * elem + written \
                + (m * kk * out_elem if k["residual"] else 0)
            bytes_ += (k.get("split_k", 1) - 1) * 2 * m * kk * out_elem  # split-K: each slice's partial sum out and in
        ctas = int(np.prod(k["grid"]))
        per_sm = max(1, min(spec.shared_memory_per_sm // max(1, k["shared_bytes"]), 1536 // k["threads"]))
        slots = spec.sm_count * per_sm
        waves = -(-ctas // slots)
        efficiency = ctas / (waves * slots)
        # a grouped kernel's tensor cores also multiply the zeros of the groups it does not compute
        compute_us = k["flops"] * k.get("tensor_core_work", 1) / (peak * efficiency) * 1e6
        total_us += row(k, bytes_, ctas, per_sm, waves, round(efficiency, 3), compute_us)
    for k in record.get("pool_classifiers", []):  # CUDA cores; every block reads the whole feature map (counted
        # as DRAM traffic, though the last convolution just wrote it to L2), the classifier's weights once
        int8 = k["precision"] == "int8"
        n, h, w, c = k["pooled"]
        bytes_ = k["grid"][0] * n * h * w * c * (4 if k["input"] == "float32" else 2) \
            + k["classes"] * c * (1 if int8 else 2) + n * k["classes"] * 4
        per_sm = SIMT_INT32_OPS_PER_CLOCK_PER_SM if int8 else SIMT_FP32_OPS_PER_CLOCK_PER_SM
        efficiency = k["grid"][0] / spec.sm_count
        compute_us = (k["flops"] + k["pool_adds"]) / (per_sm * spec.sm_count * clock * efficiency) * 1e6
        total_us += row(k, bytes_, k["grid"][0], 1, 1, round(efficiency, 3), compute_us)
    for k in record.get("squeeze_excitations", []):  # CUDA cores: x read and the product written once, the gate's
        # multiply-adds in every block
        n, h, w, c = k["x"]
        size = {"float32": 4, "float16": 2, "int8": 1}
        bytes_ = n * h * w * c * (size[k["input"]] + size[k["output"]])
        ctas = k["grid"][0]
        compute_us = 2 * k["gate_macs"] * ctas / (SIMT_FP32_OPS_PER_CLOCK_PER_SM * spec.sm_count * clock) * 1e6
        total_us += row(k, bytes_, ctas, None, None, None, compute_us)
    for k in record.get("attention_scores", []):  # CUDA cores: Q and K read (fp16) by every row's warp from L2,
        # counted once from DRAM, the fp16 probabilities written
        b, heads, rows, keys = k["scores"]
        bytes_ = b * heads * (rows + keys) * k["head_dim"] * 2 + b * heads * rows * keys * 2
        ctas = k["grid"][0]
        compute_us = k["flops"] / (SIMT_FP32_OPS_PER_CLOCK_PER_SM * spec.sm_count * clock) * 1e6
        total_us += row(k, bytes_, ctas, None, None, None, compute_us)
    size = {"float32": 4, "float16": 2, "int8": 1, "float32 per-token scale": 0}
    for k in record.get("layer_norms", []) + record.get("row_quantizes", []):  # memory-bound: the float32 (or
        # fp16) rows read once, each output written (a per-token scale: 4 bytes a row)
        *rows, c = k["shape"]
        count = int(np.prod(rows))
        outputs = k.get("outputs") or ["float32 per-token scale", "int8"]
        bytes_ = count * c * (size[k.get("input", "float32")] + sum(size[o] for o in outputs)) \
            + 4 * count * sum(o == "float32 per-token scale" for o in outputs)
        total_us += row(k, bytes_, k["grid"][0], None, None, None, 0.0)
    launches = gpu["kernels_per_inference"]
    total_us += launches * LAUNCH_US
    return {"device": device, "clock_mhz": spec.clock_mhz, "sms": spec.sm_count, "cutlass_us": round(sum(
        k["us"] for k in kernels), 1), "launches": launches, "launch_us": LAUNCH_US, "ms": round(total_us / 1e3, 4),
        "left_to_dlight": [x["conv"] for x in record["left"]], "kernels": kernels}


def tvm_default_launches(model: Path) -> int:
    """Kernel launches per inference of the fp32 graph as TVM's default CUDA pipeline leaves it (no BatchNorm
    folding, dlight's ApplyDefaultSchedule; reshapes as views): counted before any device code is built."""
    from edgeq.compile import toolchain_for
    from edgeq.graph import call_op
    from edgeq.load import load_model
    from edgeq.relax_import import to_relax
    from edgeq.targets import profiles
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as cuda

    profile = profiles()[DEVICE]
    toolchain_for(profile)
    graph, _ = to_relax(load_model(model, {}, {}))
    launches = 0

    def visit(expr):
        nonlocal launches
        launches += call_op(expr) == "relax.call_tir"

    with tvm.target.Target(profile.tvm_target()) as target:
        passes = cuda.library_dispatch_passes(target) + cuda.legalize_passes(target) + cuda.dataflow_lower_passes(target)[:1]
        mod = tvm.transform.Sequential(passes)(graph.mod)
    relax.analysis.post_order_visit(mod["main"], visit)
    return launches


def calibration(model: Path, out: Path, samples: int = 4) -> Path:
    shape = [d.dim_value for d in onnx.load(model, load_external_data=False).graph.input[0].type.tensor_type.shape.dim]
    path = out / f"{model.stem}-calib.npz"
    np.savez(path, input=np.random.default_rng(0).standard_normal((samples, *shape[1:])).astype(np.float32))
    return path


def table(rows: list[dict]) -> str:
    lines = ["| model | precision | kernels per inference | tensorized (tensor-core / conv+matmul launches) | weights (MB) |"
             " conv/matmul on dlight's fallback rule | tensor-core schedules built without software pipeline |"
             " tensor-core schedules that fell back |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tvm_default_launches" in r:
            lines.append(f"| {r['model']} | fp32, TVM's default pipeline | {r['tvm_default_launches']} | - | | | | |")
            continue
        share = "-" if r["tensor_core_instruction"] is None else (
            f"{r['tensor_core_launches']}/{r['conv_matmul_launches']} ({r['tensor_core_instruction']})")
        graph = f" (CUDA graph: {r['cuda_graph_kernels']})" if r["cuda_graph"] else ""
        if r.get("cutlass"):
            c = r["cutlass"]
            share += (f"; CUTLASS: {c['on_tensor_cores']}/{c['kernels']} kernels, "
                      f"{100 * (c.get('tensor_core_flops_share') or 0):.1f}% of FLOPs on tensor cores")
            if c.get("depthwise"):
                share += f", {c['depthwise']} depthwise on edgeq's kernel"
        if r.get("orin_estimate"):
            e = r["orin_estimate"]
            share += f"; Orin Nano estimate {e['ms']:.2f} ms (CUTLASS kernels {e['cutlass_us'] / 1e3:.2f} ms)"
        lines.append(f"| {r['model']} | {r['precision']} | {r['kernels_per_inference']}{graph} | {share} | "
                     f"{r['weight_bytes'] / 1e6:.1f} | {len(r['on_fallback_rule'])} | {len(r['pipeline_retries'])} | "
                     f"{len(r['tensor_core_fallbacks'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"], choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8"], choices=["fp32", "fp16", "int8"])
    parser.add_argument("--onnx", action="append", default=[], metavar="MODEL=PATH",
                        help="use this ONNX file for MODEL instead of the onnx-helper builder")
    parser.add_argument("--batch", type=int, default=1, help="the builders' batch size (default 1)")
    parser.add_argument("--keep", type=Path, help="keep the bundles here")
    parser.add_argument("--before", action="store_true",
                        help="also count the fp32 launches of TVM's default CUDA pipeline (no edgeq graph clean-up)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--gpu-kernels", choices=["dlight", "cutlass"], default="dlight",
                        help="edgeq package --gpu-kernels (cutlass: fp16 and int8; its rows add the share of "
                             "conv/matmul FLOPs in CUTLASS kernels whose SASS has HMMA/IMMA, and the Orin Nano's "
                             "roofline estimate, orin_estimate)")
    args = parser.parse_args()
    given = dict(item.split("=", 1) for item in args.onnx)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            model = Path(given[name]) if name in given else MODELS[name](
                work / f"{name}.onnx", **({"batch": args.batch} if args.batch != 1 else {}))
            calib = calibration(model, work, samples=max(4, args.batch))
            if args.before:
                row = {"model": name, "precision": "fp32", "tvm_default_launches": tvm_default_launches(model)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            for precision in args.precisions:
                row = {"model": name, "batch": args.batch,
                       **package_and_measure(model, precision, work / name, calib, args.gpu_kernels)}
                rows.append(row)
                if not args.json:
                    print(table([row]).splitlines()[-1], flush=True)
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
