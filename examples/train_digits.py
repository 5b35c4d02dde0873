"""Train a small CNN on scikit-learn's digits (8x8 grey images, shipped with scikit-learn: nothing is
downloaded) with plain numpy, and export it to ONNX with the onnx helper API.

Writes, deterministically (fixed seed and split):
    digits_cnn.onnx     Conv3x3(8) ReLU -> Conv3x3/2(16) ReLU -> Flatten -> Gemm(10), input 1x1x8x8
    digits_calib.npz    'input': 256 training images (calibration data)
    digits_test.npz     'input' + 'labels': the held-out test split (360 images)
and prints the float model's accuracy on the test split (the number an int8 build is compared with).

    python examples/train_digits.py [-o examples/models]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SEED = 0


def im2col_indices(channels: int, size: int, k: int, stride: int, pad: int):
    out = (size + 2 * pad - k) // stride + 1
    i0 = np.tile(np.repeat(np.arange(k), k), channels)
    i1 = stride * np.repeat(np.arange(out), out)
    j0 = np.tile(np.arange(k), k * channels)
    j1 = stride * np.tile(np.arange(out), out)
    rows = i0[:, None] + i1[None, :]
    cols = j0[:, None] + j1[None, :]
    chans = np.repeat(np.arange(channels), k * k)[:, None]
    return chans, rows, cols, out


class Conv:
    def __init__(self, rng, cin: int, cout: int, size: int, stride: int):
        self.w = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))).astype(np.float32)
        self.b = np.zeros(cout, np.float32)
        self.stride, self.size = stride, size
        self.idx = im2col_indices(cin, size, 3, stride, 1)

    def forward(self, x):
        c, r, q, out = self.idx
        xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        self.cols = xp[:, c, r, q]  # (N, C*9, out*out)
        self.shape = xp.shape
        y = np.einsum("fk,nkp->nfp", self.w.reshape(len(self.w), -1), self.cols) + self.b[None, :, None]
        return y.reshape(len(x), len(self.w), out, out)

    def backward(self, dy):
        n, f = dy.shape[:2]
        dy = dy.reshape(n, f, -1)
        self.dw = np.einsum("nfp,nkp->fk", dy, self.cols).reshape(self.w.shape)
        self.db = dy.sum(axis=(0, 2))
        dcols = np.einsum("fk,nfp->nkp", self.w.reshape(f, -1), dy)
        dxp = np.zeros(self.shape, np.float32)
        c, r, q, _ = self.idx
        np.add.at(dxp, (slice(None), c, r, q), dcols)
        return dxp[:, :, 1:-1, 1:-1]


def train(x_train, y_train, epochs: int = 30, batch: int = 32, lr: float = 0.005):
    rng = np.random.default_rng(SEED)
    conv1, conv2 = Conv(rng, 1, 8, 8, 1), Conv(rng, 8, 16, 8, 2)
    fc_w = (rng.standard_normal((10, 256)) * np.sqrt(2.0 / 256)).astype(np.float32)
    fc_b = np.zeros(10, np.float32)
    params = [conv1.w, conv1.b, conv2.w, conv2.b, fc_w, fc_b]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), batch):
            idx = order[start : start + batch]
            x, y = x_train[idx], y_train[idx]
            h1 = conv1.forward(x)
            a1 = np.maximum(h1, 0)
            h2 = conv2.forward(a1)
            a2 = np.maximum(h2, 0)
            flat = a2.reshape(len(x), -1)
            logits = flat @ fc_w.T + fc_b
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            dlogits = p
            dlogits[np.arange(len(y)), y] -= 1
            dlogits /= len(y)
            d_fc_w, d_fc_b = dlogits.T @ flat, dlogits.sum(axis=0)
            da2 = (dlogits @ fc_w).reshape(a2.shape) * (h2 > 0)
            da1 = conv2.backward(da2) * (h1 > 0)
            conv1.backward(da1)
            grads = [conv1.dw, conv1.db, conv2.dw, conv2.db, d_fc_w, d_fc_b]
            step += 1
            for p_, g, m_, v_ in zip(params, grads, m, v):  # Adam
                m_ *= 0.9
                m_ += 0.1 * g
                v_ *= 0.999
                v_ += 0.001 * g * g
                p_ -= lr * (m_ / (1 - 0.9**step)) / (np.sqrt(v_ / (1 - 0.999**step)) + 1e-8)
    return {"w1": conv1.w, "b1": conv1.b, "w2": conv2.w, "b2": conv2.b, "fc_w": fc_w, "fc_b": fc_b}


def conv(x, w, b, stride: int):
    """3x3 convolution, padding 1, of a batch ``x`` (N, C, H, W)."""
    c, r, q, out = im2col_indices(x.shape[1], x.shape[2], 3, stride, 1)
    cols = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))[:, c, r, q]
    y = np.einsum("fk,nkp->nfp", w.reshape(len(w), -1), cols) + b[None, :, None]
    return y.reshape(len(x), len(w), out, out)


def predict(p: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The network of ``to_onnx``, in numpy: class indices for a batch of images."""
    a1 = np.maximum(conv(x, p["w1"], p["b1"], 1), 0)
    a2 = np.maximum(conv(a1, p["w2"], p["b2"], 2), 0)
    return (a2.reshape(len(x), -1) @ p["fc_w"].T + p["fc_b"]).argmax(axis=1)


def accuracy(model: Path, test: Path) -> float:
    """The float model's top-1 accuracy on a test file ('input', 'labels'), from the ONNX file's weights."""
    params = {t.name: numpy_helper.to_array(t) for t in onnx.load(model).graph.initializer}
    data = np.load(test)
    return float((predict(params, data["input"]) == data["labels"]).mean())


def to_onnx(p: dict[str, np.ndarray]) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[3, 3], pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Flatten", ["r2"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "digits_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in p.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edgeq-examples")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def split():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8) in [0, 1]
    return train_test_split(x, digits.target.astype(np.int64), test_size=0.2, random_state=SEED, stratify=digits.target)


def write(out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    x_train, x_test, y_train, y_test = split()
    params = train(x_train, y_train)
    paths = {"model": out_dir / "digits_cnn.onnx", "calib": out_dir / "digits_calib.npz", "test": out_dir / "digits_test.npz"}
    onnx.save_model(to_onnx(params), paths["model"])
    np.savez(paths["calib"], input=x_train[:256])
    np.savez(paths["test"], input=x_test, labels=y_test)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=Path(__file__).parent / "models")
    paths = write(parser.parse_args().out)
    for path in paths.values():
        print(path)
    n = len(np.load(paths["test"])["labels"])
    print(f"float model accuracy on the {n} test images: {accuracy(paths['model'], paths['test']):.1%}")


if __name__ == "__main__":
    main()
