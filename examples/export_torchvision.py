"""Export torchvision's classification and segmentation models to ONNX, the way users export them.

``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``), opset 17, random weights
(``weights=None``, torchvision's own init, fixed seed; a weight matrix torchvision initialises to all zeros,
ViT's head, gets N(0, 0.02) so outputs are not identically 0), eval mode, batch 1. Segmentation builders (DeepLabV3, LR-ASPP, FCN) are exported without their auxiliary head
and without a pretrained backbone, their ``out`` map as the output ``out``. Nothing is downloaded. Runs in the export
environment that ``scripts/setup.sh`` makes (``.venv-export``, torch + torchvision only: tvm-ffi imports
torch whenever it is installed beside it, which would slow every edgeq command):

    .venv-export/bin/python examples/export_torchvision.py -o zoo/ resnet18 mobilenet_v3_small --size 224
    .venv-export/bin/python examples/export_torchvision.py --list          # every builder
    .venv-export/bin/python examples/export_torchvision.py --families      # one per family

Prints one JSON line per model: {"name", "path", "size", "seconds"}. A model already exported with the
same size is not exported again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

OPSET = 17
# One builder per architecture family (the smallest of each): what `--families` exports.
FAMILIES = [
    "alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
    "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small",
    "regnet_x_400mf", "regnet_y_400mf", "resnet18", "resnext50_32x4d", "shufflenet_v2_x0_5",
    "squeezenet1_1", "swin_t", "swin_v2_t", "vgg11", "vit_b_16", "wide_resnet50_2",
]
# Builders whose input size is fixed by the architecture (ViT's position embedding, MaxViT's windows).
FIXED_SIZE = {"vit_b_16": 224, "vit_b_32": 224, "vit_l_16": 224, "vit_l_32": 224, "vit_h_14": 224, "maxvit_t": 224}
# AlexNet's and VGG's adaptive average pool (to 6x6, 7x7) exports only when its input is that size already (the
# exporter refuses an output size that does not divide the input's): their features are 6x6 and 7x7 at 224.
FIXED_SIZE |= {name: 224 for name in ("alexnet", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn",
                                      "vgg19", "vgg19_bn")}
MIN_SIZE = {"inception_v3": 75, "googlenet": 32}
# Segmentation builders: the smallest of each head (ASPP, LR-ASPP), what `--segmentation` exports.
SEGMENTATION = ["deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"]


def input_size(name: str, size: int) -> int:
    return FIXED_SIZE.get(name, max(size, MIN_SIZE.get(name, 32)))


def import_torchvision():
    """torchvision, also beside torch's CPU build (what ``scripts/setup.sh`` installs: 1 GB, not 5.5).

    PyPI has torchvision only as a CUDA build; beside a CPU torch its C operators (nms, roi_align, ...) do not
    load, and its import then fails registering fake kernels for two of them. No classification model uses
    them: their schemas are declared (never implemented) and torchvision imported again."""
    import torch

    try:
        import torchvision
    except RuntimeError as err:
        if "torchvision::nms does not exist" not in str(err):
            raise
        for module in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[module]
        global _DECLARED
        _DECLARED = torch.library.Library("torchvision", "DEF")  # kept alive: dropping it removes the schemas
        for op in ("nms", "qnms"):
            _DECLARED.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision
    return torchvision


_DECLARED = None


def _OutMap(model):
    """A segmentation model returns a dict ({"out": map}); users export its map."""
    import torch

    class OutMap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)["out"]

    return OutMap(model).eval()


def export(name: str, out_dir: Path, size: int) -> dict:
    import torch

    torchvision = import_torchvision()

    size = input_size(name, size)
    path = out_dir / f"{name}-{size}.onnx"
    if path.is_file():
        return {"name": name, "path": str(path), "size": size, "seconds": 0.0}
    torch.manual_seed(0)
    segmentation = name in torchvision.models.list_models(module=torchvision.models.segmentation)
    kwargs = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
    if segmentation:
        kwargs = {"weights_backbone": None, "aux_loss": False} if name != "lraspp_mobilenet_v3_large" else \
            {"weights_backbone": None}
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    if segmentation:
        model = _OutMap(model)
    with torch.no_grad():  # a zero-initialised layer (ViT's head) would make every output 0: nothing to compare
        for param in model.parameters():
            if param.ndim >= 2 and not param.any():
                param.normal_(0.0, 0.02)
    start = time.perf_counter()
    tmp = path.with_suffix(".part")
    torch.backends.mha.set_fastpath_enabled(False)  # the fused attention kernel has no ONNX export
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, size, size),), str(tmp), opset_version=OPSET, dynamo=False,
                          input_names=["input"], output_names=["out" if segmentation else "logits"])
    tmp.replace(path)
    return {"name": name, "path": str(path), "size": size, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="builder names (torchvision.models.list_models())")
    parser.add_argument("-o", "--output", type=Path, default=Path("zoo"))
    parser.add_argument("--size", type=int, default=224, help="input height and width (default 224)")
    parser.add_argument("--list", action="store_true", help="export every classification builder")
    parser.add_argument("--families", action="store_true", help="export one builder per family")
    parser.add_argument("--segmentation", action="store_true", help="export one builder per segmentation head")
    args = parser.parse_args(argv)
    torchvision = import_torchvision()

    every = torchvision.models.list_models(module=torchvision.models)
    segmentation = torchvision.models.list_models(module=torchvision.models.segmentation)
    names = list(args.models) + (FAMILIES if args.families else []) \
        + (SEGMENTATION if args.segmentation else []) + (every if args.list else [])
    every = every + segmentation
    unknown = [n for n in names if n not in every]
    if unknown or not names:
        print(f"export_torchvision: unknown or no model names: {', '.join(unknown) or '(none)'}", file=sys.stderr)
        return 2
    args.output.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(names):
        print(json.dumps(export(name, args.output, args.size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
