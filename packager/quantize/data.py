"""Calibration and evaluation data: a .npz file, a folder of .npy/.npz files, or a folder of images with
``--preprocess``. Everything is checked against the model's inputs before any work starts.

Arrays hold samples along their first axis: for an input of shape (B, C, H, W) an array may be (N, C, H, W)
(N samples, run B at a time) or (N, B, C, H, W) (N batches). An optional ``labels`` array (one class index
per sample) gives top-1 accuracy. Image folders: ``root/*.png`` or ``root/<class>/*.png`` (classes sorted
by name become the labels).

Counting: one unit inside, the sample (one row of the model's batch; an image); the data is used in whole
model runs of B samples. Messages speak the unit the data came in: "3 batches of 8" for (N, B, ...) arrays,
"24 samples" otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import zipfile
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from edgeq.errors import UsageError
from edgeq.limits import check
from edgeq.templates.contract import MAX_IMAGE_SIDE, TensorSpec
from edgeq.load import npy_bytes

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
LABEL_KEYS = ("labels", "label")


class DataError(UsageError):
    """Calibration or evaluation data that does not fit the model."""


@dataclasses.dataclass
class Preprocess:
    """How images become input tensors: resize, scale to [0, 1], normalise, lay out."""

    resize: tuple[int, int] | None = None  # (H, W); default: the model input's
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    scale: float = 255.0
    layout: str = "NCHW"
    order: str = ""  # RGB, BGR or GRAY; default from the input's channel count
    fit: str = "stretch"  # stretch to the size, or letterbox (aspect kept, padded with 114, as ultralytics)

    @classmethod
    def parse(cls, text: str) -> "Preprocess":
        """``resize=224x224,mean=0.485/0.456/0.406,std=0.229/0.224/0.225,layout=NCHW,order=RGB,scale=255``."""
        pre = cls()
        for item in filter(None, (t.strip() for t in text.split(","))):
            key, sep, value = item.partition("=")
            try:
                if not sep:
                    raise ValueError
                if key == "resize":
                    h, w = (int(v) for v in value.lower().split("x"))
                    pre.resize = (h, w)
                elif key in ("mean", "std"):
                    setattr(pre, key, tuple(float(v) for v in value.split("/")))
                elif key == "scale":
                    pre.scale = float(value)
                elif key == "layout" and value.upper() in ("NCHW", "NHWC"):
                    pre.layout = value.upper()
                elif key == "order" and value.upper() in ("RGB", "BGR", "GRAY"):
                    pre.order = value.upper()
                elif key == "fit" and value.lower() in ("stretch", "letterbox"):
                    pre.fit = value.lower()
                else:
                    raise ValueError
            except ValueError:
                raise DataError(
                    f"--preprocess item '{item}' is not understood; use resize=HxW, mean=a/b/c, std=a/b/c, "
                    "scale=255, layout=NCHW|NHWC, order=RGB|BGR|GRAY, fit=stretch|letterbox"
                ) from None
        if any(s == 0 for s in pre.std):
            raise DataError("--preprocess std must not be 0")
        if not all(math.isfinite(v) for v in (*pre.mean, *pre.std, pre.scale)) or pre.scale == 0:
            raise DataError("--preprocess mean, std and scale must be finite numbers (scale not 0)")
        if pre.resize and not all(0 < d <= MAX_IMAGE_SIDE for d in pre.resize):
            raise DataError(f"--preprocess resize={pre.resize[0]}x{pre.resize[1]} must be 1 to {MAX_IMAGE_SIDE} pixels a side")
        return pre

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def record(self, spec: TensorSpec):
        """The manifest's ``preprocess`` for input ``spec`` (what ``imaging.image_tensor`` applies): checked
        against the input's channels; the size is the input's (``resize`` must agree where given)."""
        from edgeq.templates import contract

        if len(spec.shape) != 4 or self.layout == "NCHW" and spec.shape[1] not in (1, 3) \
                or self.layout == "NHWC" and spec.shape[3] not in (1, 3):
            raise DataError(f"--preprocess: input '{spec.name}' ({'x'.join(map(str, spec.shape))}) is not an image input "
                            f"in {self.layout} with 1 or 3 channels")
        shape = spec.shape
        channels = shape[1] if self.layout == "NCHW" else shape[-1]
        size = (shape[2], shape[3]) if self.layout == "NCHW" else (shape[1], shape[2])
        if not all(1 <= d <= MAX_IMAGE_SIDE for d in size):
            raise DataError(f"--preprocess: input '{spec.name}' is {size[0]}x{size[1]} pixels; images go to inputs of 1 to "
                            f"{MAX_IMAGE_SIDE} pixels a side")
        if self.resize and tuple(self.resize) != size:
            raise DataError(f"--preprocess resize={self.resize[0]}x{self.resize[1]} is not input '{spec.name}''s "
                            f"{size[0]}x{size[1]}; leave resize out (the input's size is used)")
        order = self.order or ("GRAY" if channels == 1 else "RGB")
        if (order == "GRAY") != (channels == 1):
            raise DataError(f"--preprocess order={order} gives {1 if order == 'GRAY' else 3} channels; input '{spec.name}' "
                            f"has {channels}")
        for key in ("mean", "std"):
            if len(getattr(self, key)) not in (1, channels):
                raise DataError(f"--preprocess {key} has {len(getattr(self, key))} values; input '{spec.name}' has "
                                f"{channels} channels: give 1 or {channels}")
        return contract.PreprocessRecord(input=spec.name, height=size[0], width=size[1], resize=self.fit, order=order,
                                         layout=self.layout, scale=float(self.scale), mean=[float(v) for v in self.mean],
                                         std=[float(v) for v in self.std])


@dataclasses.dataclass
class Dataset:
    """Samples per input (first axis = sample) and optional labels. ``batched``: the arrays came as batches of
    the model's batch ``batch`` (N, B, ...), so messages count batches."""

    arrays: dict[str, np.ndarray]
    labels: np.ndarray | None
    source: str
    batch: int = 1
    batched: bool = False

    @property
    def count(self) -> int:
        """Samples (rows of the model's batch), whatever the unit of the data."""
        return len(next(iter(self.arrays.values())))

    @property
    def runs(self) -> int:
        """Model runs the data fills (samples left over that do not fill a batch are not used)."""
        return self.count // self.batch

    def describe(self, samples: int | None = None) -> str:
        """``samples`` (default: all) in the unit the data came in: 'N batches of B' or 'N samples'."""
        n = self.count if samples is None else samples
        if self.batched and self.batch > 1:
            k = n // self.batch
            return f"{k} batch{'' if k == 1 else 'es'} of {self.batch}"
        return f"{n} sample{'' if n == 1 else 's'}"

    def batches(self, specs: list[TensorSpec]) -> Iterator[list[np.ndarray]]:
        """Model-shaped input lists: B consecutive samples per run for a batch-B input."""
        batch = specs[0].shape[0] if specs[0].shape else 1
        for start in range(0, self.count - batch + 1, batch):
            yield [self.arrays[s.name][start : start + batch].reshape(s.shape) for s in specs]

    def take(self, n: int) -> "Dataset":
        return dataclasses.replace(self, arrays={k: v[:n] for k, v in self.arrays.items()},
                                   labels=None if self.labels is None else self.labels[:n])


def _batch(specs: list[TensorSpec]) -> int:
    """Samples per model run: the first input's batch (1 for a scalar input)."""
    return max(1, int(specs[0].shape[0])) if specs and specs[0].shape else 1


def _sample_view(name: str, array: np.ndarray, spec: TensorSpec, what: str) -> tuple[np.ndarray, bool]:
    """``array`` as (N, *per-sample shape) where a sample is one row of the input's batch, and whether it came
    as batches (N, *input shape) rather than samples."""
    shape = tuple(spec.shape)
    per_sample = shape[1:] if shape else ()
    batched = False
    if array.shape[1:] == per_sample and array.ndim == len(shape):
        out = array
    elif array.shape[1:] == shape:
        out, batched = array.reshape((-1,) + per_sample), True
    else:
        want = "x".join(map(str, (("N",) + per_sample)))
        raise DataError(
            f"{what} array '{name}' has shape {'x'.join(map(str, array.shape))}; input '{spec.name}' "
            f"({'x'.join(map(str, shape))}) needs {want} (samples first)"
        )
    want_dtype = np.dtype(spec.dtype)
    if out.dtype != want_dtype:
        if out.dtype.kind == "f" and want_dtype.kind == "f":
            out = out.astype(want_dtype)
        else:
            raise DataError(
                f"{what} array '{name}' is {out.dtype} but input '{spec.name}' is {want_dtype}; "
                "convert the data (images: use a folder with --preprocess)"
            )
    if out.dtype.kind == "f" and not np.isfinite(out).all():
        bad = int(np.argmax(~np.isfinite(out.reshape(len(out), -1)).all(axis=1)))
        raise DataError(f"{what} array '{name}' has NaN or Inf (first in sample {bad}); clean the data")
    return out, batched


def _from_arrays(arrays: dict[str, np.ndarray], specs: list[TensorSpec], what: str, source: str) -> Dataset:
    labels = next((arrays.pop(k) for k in LABEL_KEYS if k in arrays), None)
    names = [s.name for s in specs]
    if len(specs) == 1 and len(arrays) == 1 and names[0] not in arrays and next(iter(arrays)) == "arr_0":
        arrays = {names[0]: arrays.pop("arr_0")}  # a bare .npy or np.savez(f, x): the single input
    unknown = sorted(set(arrays) - set(names))
    if unknown:
        raise DataError(f"{what} data {source} has array(s) {', '.join(unknown)} but the model's inputs are: {', '.join(names)}")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise DataError(f"{what} data {source} has no array for input(s) {', '.join(missing)}")
    checked = {s.name: _sample_view(s.name, arrays[s.name], s, what) for s in specs}
    views = {name: view for name, (view, _) in checked.items()}
    counts = {len(v) for v in views.values()}
    if len(counts) != 1:
        raise DataError(f"{what} data {source}: inputs have different sample counts {sorted(counts)}")
    if labels is not None:
        labels = np.asarray(labels).reshape(-1)
        if labels.dtype.kind not in "iu" or len(labels) != counts.pop():
            raise DataError(f"{what} data {source}: 'labels' must be one integer class per sample")
    return Dataset(views, labels, source, _batch(specs), all(batched for _, batched in checked.values()))


def _read_npz(path: Path, spent: list[int]) -> dict[str, np.ndarray]:
    """Arrays of a .npy / .npz; their sizes, read from the headers, add to ``spent[0]`` (bytes of all the
    data so far), which must stay within the data limit."""
    try:
        if path.suffix == ".npy":
            with open(path, "rb") as f:
                _spend(spent, npy_bytes(f), path)
            return {"arr_0": np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as archive:
            for name in archive.files:
                with archive.zip.open(f"{name}.npy") as member:
                    _spend(spent, npy_bytes(member), path)
            return {k: archive[k] for k in archive.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise DataError(f"cannot read {path}: {reason}") from None


def _spend(spent: list[int], size: int, path: Path) -> None:
    spent[0] += size
    check("data_bytes", f"the data up to {path}", spent[0], DataError)


def _images(paths: list[Path], root: Path, spec: TensorSpec, pre: Preprocess, what: str) -> Dataset:
    """Images as samples of input ``spec``, prepared exactly as run.py and edgeq-run prepare ``--input IMAGE``
    (``imaging.image_tensor``), so that a bundle sees on the device the tensors it was calibrated on."""
    from PIL import Image, UnidentifiedImageError

    from edgeq.templates import imaging

    record = pre.record(spec)
    classes = sorted({p.parent.relative_to(root).as_posix() for p in paths} - {"."})
    samples, labels = [], []
    for path in paths:
        try:
            with Image.open(path) as image:  # the size is checked before any pixel is decoded
                check("image_pixels", f"image {path}", image.width * image.height, DataError, unit="pixels")
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as err:
            raise DataError(f"cannot read image {path}: {err}") from None
        try:
            pixels = imaging.decode_image(np, str(path), any_format=True, max_pixels=1 << 62)  # checked above
        except (imaging.ImageError, OSError) as err:
            raise DataError(f"cannot read image {path}: {err}") from None
        samples.append(imaging.image_tensor(np, pixels, record)[0])
        if classes:
            labels.append(classes.index(path.parent.relative_to(root).as_posix()))
    arrays = {spec.name: np.stack(samples).astype(spec.dtype)}
    if classes:
        arrays["labels"] = np.asarray(labels, np.int64)
    return _from_arrays(arrays, [spec], what, str(root))


def warn_line(text: str) -> None:
    print(f"edgeq: warning: {text}", file=sys.stderr, flush=True)


def load_data(path: str | Path, specs: list[TensorSpec], what: str = "calibration",
              preprocess: Preprocess | None = None, limit: int | None = None, minimum: int = 1,
              warn: Callable[[str], None] | None = None) -> Dataset:
    """Read and check data for the model's inputs. ``what`` names the data in error messages.

    ``limit``: samples to use at most, in whole model runs (at least one run, so a limit under the model's
    batch still takes one batch). ``minimum``: samples below which the data is used with a warning (``warn``,
    default: a line on stderr); only less than one model run is refused."""
    path = Path(path)
    spent = [0]
    if not path.exists():
        raise DataError(f"{what} data not found: {path}")
    if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:  # one image
        if preprocess is None:
            raise DataError(f"{what} {path} is an image: say how to prepare it with --preprocess")
        if len(specs) != 1:
            raise DataError(f"an image as {what} needs a model with one input; this one has {len(specs)}")
        data = _images([path], path.parent, specs[0], preprocess, what)
    elif path.is_file():
        if path.suffix not in (".npz", ".npy"):
            raise DataError(f"{what} data {path} is not .npz or .npy; give a .npz, a folder of .npy/.npz, or images")
        data = _from_arrays(_read_npz(path, spent), specs, what, str(path))
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
        arrays = [p for p in files if p.suffix in (".npy", ".npz")]
        if images and not arrays:
            if preprocess is None:
                raise DataError(f"{what} folder {path} holds images: say how to prepare them with --preprocess")
            if len(specs) != 1:
                raise DataError(f"image {what} data needs a model with one input; this one has {len(specs)}")
            data = _images(images, path, specs[0], preprocess, what)
        elif arrays:
            parts = [_from_arrays(_read_npz(p, spent), specs, what, str(p)) for p in arrays]
            merged = {s.name: np.concatenate([d.arrays[s.name] for d in parts]) for s in specs}
            labels = [d.labels for d in parts]
            data = Dataset(merged, np.concatenate(labels) if all(x is not None for x in labels) else None, str(path),
                           _batch(specs), all(d.batched for d in parts))
        else:
            raise DataError(f"{what} folder {path} has no .npy, .npz or image files")
    batch = data.batch
    if data.count < batch or data.count == 0:
        if batch == 1:
            raise DataError(f"{what} data {data.source} has {data.describe()}; give at least 1 sample")
        raise DataError(f"{what} data {data.source} has {data.describe()}; the model runs {batch} at a time: give at "
                        f"least 1 batch of {batch} (an array of {'x'.join(map(str, ('N', *specs[0].shape)))}) "
                        f"or {batch} samples")
    if limit is not None:
        data = data.take(max(1, limit // batch) * batch)
    leftover = data.count % batch
    if leftover:
        (warn or warn_line)(f"{what} data {data.source}: the last {leftover} of {data.describe()} do not fill a batch of "
                        f"{batch} and are not used")
        data = data.take(data.count - leftover)
    if data.count < minimum:
        (warn or warn_line)(f"{what} data {data.source} has only {data.describe()}; ranges from fewer than {minimum} "
                        f"samples may not cover real inputs: give more for better scales")
    return data


def load_golden(path: str | Path, specs: list[TensorSpec], preprocess: Preprocess | None = None) -> list[np.ndarray]:
    """The arrays of ``--golden-input``, one per input in the model's order: an .npz/.npy whose arrays have the
    inputs' exact shapes, else data in the calibration formats (samples first; an image with ``preprocess``)
    of which the first model run is taken."""
    path = Path(path)
    what = "golden input"
    if path.is_file() and path.suffix in (".npz", ".npy"):
        arrays = _read_npz(path, [0])
        if len(specs) == 1 and list(arrays) == ["arr_0"]:
            arrays = {specs[0].name: arrays["arr_0"]}
        if set(arrays) == {s.name for s in specs} and all(tuple(arrays[s.name].shape) == tuple(s.shape) for s in specs):
            # one model run: checked (dtype, finite values) as a batch of one is
            return [np.ascontiguousarray(_sample_view(s.name, arrays[s.name][None], s, what)[0].reshape(s.shape))
                    for s in specs]
    data = load_data(path, specs, what, preprocess, limit=1)
    return next(data.batches(specs))
