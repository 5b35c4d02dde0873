"""Make the example ONNX models used by the README, tests and benchmarks.

Built with the onnx helper API from fixed random seeds: the same bytes on every machine, nothing
downloaded. Each builder takes its sizes as arguments so tests can make small versions.

    python examples/make_models.py [-o examples/models]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class GraphBuilder:
    """Collects nodes and initializers; names are generated so builders read like the network."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def const(self, prefix: str, array: np.ndarray) -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, prefix: str, shape: tuple[int, ...], fan_in: int) -> str:
        scale = np.sqrt(2.0 / fan_in)
        return self.const(prefix, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], prefix: str | None = None, **attrs) -> str:
        out = self.name(prefix or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> str:
        w = self.weight("w", (cout, cin // groups, k, k), fan_in=cin // groups * k * k)
        b = self.const("b", (self.rng.standard_normal(cout) * 0.05).astype(np.float32))
        pad = k // 2
        return self.op("Conv", [x, w, b], "conv", kernel_shape=[k, k], strides=[stride, stride],
                       pads=[pad] * 4, group=groups)

    def relu(self, x: str) -> str:
        return self.op("Relu", [x])

    def gemm(self, x: str, cin: int, cout: int) -> str:
        w = self.weight("fc_w", (cout, cin), fan_in=cin)
        b = self.const("fc_b", np.zeros(cout, np.float32))
        return self.op("Gemm", [x, w, b], "fc", transB=1)

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="edgeq-examples")
        model.ir_version = 8
        onnx.checker.check_model(model, full_check=True)
        return model


def _io(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def resnet_cnn(size: int = 32, width: int = 16, blocks: int = 2, classes: int = 10, batch=1) -> onnx.ModelProto:
    """A small ResNet-style CNN: stem conv, residual basic blocks (stride 2 + 1x1 shortcut), GAP, FC."""
    g = GraphBuilder(seed=1)
    x = g.relu(g.conv("input", 3, width, 3))
    cin = width
    for i in range(blocks):
        cout, stride = cin * (2 if i else 1), 2 if i else 1
        y = g.relu(g.conv(x, cin, cout, 3, stride))
        y = g.conv(y, cout, cout, 3)
        short = x if (stride == 1 and cin == cout) else g.conv(x, cin, cout, 1, stride)
        x = g.relu(g.op("Add", [y, short]))
        cin = cout
    x = g.op("GlobalAveragePool", [x], "gap")
    x = g.op("Flatten", [x], "flatten", axis=1)
    g.gemm(x, cin, classes)
    g.nodes[-1].output[0] = "logits"
    return g.model("resnet_cnn", [_io("input", (batch, 3, size, size))], [_io("logits", (batch, classes))])


def mobilenet_cnn(size: int = 32, width: int = 16, classes: int = 10, batch=1) -> onnx.ModelProto:
    """A MobileNet-style CNN: depthwise-separable blocks with ReLU6 (Clip) and stride-2 depthwise convs."""
    g = GraphBuilder(seed=2)
    lo, hi = g.const("relu6_lo", np.array(0, np.float32)), g.const("relu6_hi", np.array(6, np.float32))

    def relu6(t: str) -> str:
        return g.op("Clip", [t, lo, hi], "relu6")

    x = relu6(g.conv("input", 3, width, 3, stride=2))
    cin = width
    for cout, stride in ((width * 2, 1), (width * 4, 2), (width * 4, 1)):
        x = relu6(g.conv(x, cin, cin, 3, stride, groups=cin))  # depthwise
        x = relu6(g.conv(x, cin, cout, 1))  # pointwise
        cin = cout
    x = g.op("GlobalAveragePool", [x], "gap")
    x = g.op("Flatten", [x], "flatten", axis=1)
    g.gemm(x, cin, classes)
    g.nodes[-1].output[0] = "logits"
    return g.model("mobilenet_cnn", [_io("input", (batch, 3, size, size))], [_io("logits", (batch, classes))])


def transformer_block(seq: int = 16, dim: int = 32, heads: int = 2, batch=1) -> onnx.ModelProto:
    """A pre-norm transformer encoder block: LayerNorm, multi-head self-attention (MatMul, Softmax), MLP."""
    g = GraphBuilder(seed=3)
    head_dim = dim // heads

    def layernorm(t: str) -> str:
        scale = g.const("ln_g", np.ones(dim, np.float32))
        bias = g.const("ln_b", np.zeros(dim, np.float32))
        return g.op("LayerNormalization", [t, scale, bias], "ln", axis=-1, epsilon=1e-5)

    def linear(t: str, cin: int, cout: int) -> str:
        w = g.weight("w", (cin, cout), fan_in=cin)
        b = g.const("b", (g.rng.standard_normal(cout) * 0.02).astype(np.float32))
        return g.op("Add", [g.op("MatMul", [t, w], "matmul"), b], "bias")

    def split_heads(t: str) -> str:
        shape = g.const("shape", np.array([0, seq, heads, head_dim], np.int64))
        return g.op("Transpose", [g.op("Reshape", [t, shape], "reshape")], "transpose", perm=[0, 2, 1, 3])

    h = layernorm("input")
    q, k, v = (split_heads(linear(h, dim, dim)) for _ in range(3))
    kt = g.op("Transpose", [k], "transpose", perm=[0, 1, 3, 2])
    scores = g.op("Mul", [g.op("MatMul", [q, kt], "matmul"), g.const("scale", np.array(head_dim ** -0.5, np.float32))])
    attn = g.op("MatMul", [g.op("Softmax", [scores], "softmax", axis=-1), v], "matmul")
    merged = g.op("Reshape", [g.op("Transpose", [attn], "transpose", perm=[0, 2, 1, 3]),
                              g.const("shape", np.array([0, seq, dim], np.int64))], "reshape")
    x = g.op("Add", ["input", linear(merged, dim, dim)], "residual")
    h = layernorm(x)
    mlp = linear(g.op("Relu", [linear(h, dim, 4 * dim)]), 4 * dim, dim)
    g.op("Add", [x, mlp], "residual")
    g.nodes[-1].output[0] = "output"
    return g.model("transformer_block", [_io("input", (batch, seq, dim))], [_io("output", (batch, seq, dim))])


def resnet18(size: int = 224, classes: int = 1000, batch=1) -> onnx.ModelProto:
    """ResNet-18 (torchvision layout: 7x7/2 stem, max-pool, 4 stages of 2 basic blocks), random weights.
    Used by the speed benchmark; too big for the tests."""
    g = GraphBuilder(seed=18)
    x = g.relu(g.conv("input", 3, 64, 7, stride=2))
    x = g.op("MaxPool", [x], "maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage and not block else 1
            y = g.conv(g.relu(g.conv(x, cin, cout, 3, stride)), cout, cout, 3)
            short = x if (stride == 1 and cin == cout) else g.conv(x, cin, cout, 1, stride)
            x = g.relu(g.op("Add", [y, short]))
            cin = cout
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x], "gap")], "flatten", axis=1)
    g.gemm(x, cin, classes)
    g.nodes[-1].output[0] = "logits"
    return g.model("resnet18", [_io("input", (batch, 3, size, size))], [_io("logits", (batch, classes))])


def yolo_cnn(size: int = 128, classes: int = 4, batch=1) -> onnx.ModelProto:
    """A YOLOv8-shaped detector: a strided CNN, heads at strides 8 and 16, boxes decoded from distances to
    the anchor points (as ultralytics' dist2bbox) into xywh input pixels, sigmoid class scores; the output is
    ultralytics' [1, 4 + classes, anchors] ("output0"), without NMS. Random weights: its boxes are not of
    anything, but it has the head's shape and arithmetic."""
    g = GraphBuilder(seed=5)
    c1 = g.relu(g.conv("images", 3, 16, 3, 2))
    c2 = g.relu(g.conv(c1, 16, 32, 3, 2))
    c3 = g.relu(g.conv(c2, 32, 32, 3, 2))
    c4 = g.relu(g.conv(c3, 32, 64, 3, 2))
    heads = []
    for feature, channels, stride in ((c3, 32, 8), (c4, 64, 16)):
        cells = size // stride
        box = g.conv(feature, channels, 4, 1)
        distance = g.op("Mul", [g.op("Softplus", [box]), g.const("two", np.array(2.0, np.float32))])
        distance = g.op("Reshape", [distance, g.const("shape", np.array([batch, 4, cells * cells], np.int64))])
        ys, xs = np.mgrid[0:cells, 0:cells].astype(np.float32) + 0.5
        anchors = g.const("anchors", np.stack([xs.ravel(), ys.ravel()])[None])  # [1, 2, cells^2]
        lt = g.op("Slice", [distance, g.const("s", np.array([0], np.int64)), g.const("e", np.array([2], np.int64)),
                            g.const("a", np.array([1], np.int64))])
        rb = g.op("Slice", [distance, g.const("s", np.array([2], np.int64)), g.const("e", np.array([4], np.int64)),
                            g.const("a", np.array([1], np.int64))])
        x1y1, x2y2 = g.op("Sub", [anchors, lt]), g.op("Add", [anchors, rb])
        centre = g.op("Div", [g.op("Add", [x1y1, x2y2]), g.const("two", np.array(2.0, np.float32))])
        wh = g.op("Sub", [x2y2, x1y1])
        xywh = g.op("Mul", [g.op("Concat", [centre, wh], axis=1), g.const("stride", np.array(float(stride), np.float32))])
        logits = g.conv(feature, channels, classes, 1)
        g.inits[-1].CopyFrom(numpy_helper.from_array(np.full(classes, -2.5, np.float32), g.inits[-1].name))  # few boxes
        scores = g.op("Sigmoid", [g.op("Reshape", [logits, g.const("shape", np.array([batch, classes, cells * cells], np.int64))])])
        heads.append(g.op("Concat", [xywh, scores], axis=1))
    g.op("Concat", heads, axis=2)
    g.nodes[-1].output[0] = "output0"
    anchors_total = (size // 8) ** 2 + (size // 16) ** 2
    return g.model("yolo_cnn", [_io("images", (batch, 3, size, size))], [_io("output0", (batch, 4 + classes, anchors_total))])


YOLO_LABELS = ["car", "person", "bicycle", "traffic light"]


def street_image(path: Path, width: int = 320, height: int = 240) -> Path:
    """A drawn street scene (sky, road, cars, people, a traffic light): an image the project makes itself."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (135, 180, 230))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, height * 0.55, width, height], fill=(70, 70, 75))
    for x in range(10, width, 40):
        draw.rectangle([x, height * 0.76, x + 20, height * 0.78], fill=(230, 230, 230))
    for x, colour in ((30, (200, 30, 30)), (150, (30, 60, 200)), (235, (240, 200, 40))):
        draw.rectangle([x, height * 0.6, x + 70, height * 0.72], fill=colour)
        draw.ellipse([x + 8, height * 0.69, x + 24, height * 0.75], fill=(20, 20, 20))
        draw.ellipse([x + 46, height * 0.69, x + 62, height * 0.75], fill=(20, 20, 20))
    for x in (110, 205):
        draw.ellipse([x, height * 0.38, x + 12, height * 0.43], fill=(240, 200, 170))
        draw.rectangle([x + 1, height * 0.43, x + 11, height * 0.58], fill=(60, 120, 60))
    draw.rectangle([290, height * 0.2, 300, height * 0.55], fill=(40, 40, 40))
    draw.rectangle([284, height * 0.2, 306, height * 0.32], fill=(30, 30, 30))
    draw.ellipse([289, height * 0.21, 301, height * 0.25], fill=(220, 30, 30))
    image.save(path)
    return path


EXAMPLES = {
    "resnet_cnn": resnet_cnn,
    "mobilenet_cnn": mobilenet_cnn,
    "transformer_block": transformer_block,
}


def big_matmul(path: Path) -> Path:
    """One 2048x6144 MatMul (48 MiB of weights): a bundle large enough that an upload takes a while (the fleet
    test and benchmark kill an sshd in the middle of one)."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((2048, 6144)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2048])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6144])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in EXAMPLES.items():
        path = out_dir / f"{name}.onnx"
        onnx.save_model(build(), path)
        paths.append(path)
    return paths


def write_detector(out_dir: Path) -> list[Path]:
    """The YOLO-shaped detector, its labels and the street image of the README's detector example."""
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save_model(yolo_cnn(), out_dir / "yolo_cnn.onnx")
    (out_dir / "yolo_labels.txt").write_text("".join(f"{label}\n" for label in YOLO_LABELS))
    return [out_dir / "yolo_cnn.onnx", out_dir / "yolo_labels.txt", street_image(out_dir / "street.png")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=Path(__file__).parent / "models")
    out = parser.parse_args().out
    for path in write_all(out) + write_detector(out):
        print(path)


if __name__ == "__main__":
    main()
