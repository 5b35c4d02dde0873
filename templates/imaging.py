"""Images in, answers out: what ``run.py --input IMAGE`` and ``--postprocess`` compute, what the packager
computes of calibration images and ``--golden-input IMAGE`` (the same functions), and what edgeq-run repeats
in C++ operation by operation (``native/image.h``; the tests hold the three to the same bits). Shipped in
every bundle beside run.py. numpy comes in as an argument and Pillow/OpenCV are imported where an image is
read: importing this module needs only the standard library.
"""

import io
import os
import stat
import struct
import zlib

MAX_IMAGE_PIXELS = 50_000_000  # one image given to run.py / edgeq-run --input (a decompression bomb is refused)
MAX_IMAGE_FILE_BYTES = 256 << 20  # one image file
PAD_VALUE = 114  # letterbox padding, as ultralytics pads


PNG_MAGIC, JPEG_MAGIC = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"


def is_image(head: bytes) -> bool:
    """Whether a file's first bytes are a PNG's or a JPEG's (the formats both loaders read)."""
    return head.startswith(PNG_MAGIC) or head.startswith(JPEG_MAGIC)


class ImageError(ValueError):
    """An image that cannot be read or used: the one-line reason."""


# the chunks that make a PNG's pixels (PLTE: a palette's colours); every other chunk is checked and dropped
PNG_PIXEL_CHUNKS = (b"IHDR", b"PLTE", b"IDAT", b"IEND")


def png_pixel_chunks(data: bytes, path: str) -> bytes:
    """A PNG file's bytes reduced to the chunks that make its pixels, after every chunk's length and CRC is
    checked: what both loaders decode (edgeq-run's image.h does the same, byte for byte). Decoders differ in
    what they make of the rest (libpng converts by gAMA/sRGB, inflates zTXt/iCCP, checks IDAT CRCs; Pillow
    does none of this), so the rest is never given to them: a text chunk inflating to 256 MiB costs nothing,
    and no decoder sees a chunk whose CRC is wrong."""
    out, pos, first = [data[:8]], 8, True
    while True:
        if pos + 12 > len(data):
            raise ImageError("cannot decode %s: the PNG ends before its IEND chunk" % path)
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if length > 0x7FFFFFFF or pos + 12 + length > len(data) or not kind.isalpha():
            raise ImageError("cannot decode %s: PNG chunk at byte %d is damaged" % (path, pos))
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(data[pos + 4:pos + 8 + length]) != crc:
            raise ImageError("cannot decode %s: PNG chunk %s has a bad CRC" % (path, kind.decode("ascii")))
        if first != (kind == b"IHDR"):
            raise ImageError("cannot decode %s: a PNG starts with its IHDR chunk, once" % path)
        first = False
        if kind in PNG_PIXEL_CHUNKS:
            out.append(data[pos:pos + 12 + length])
        pos += 12 + length
        if kind == b"IEND":
            return b"".join(out)


# What edgeq-run says where it cannot open a decoding library (image.h's DecodePng/DecodeJpeg): run.py says the same
# and refuses alike, rather than decoding with Pillow what edgeq-run cannot read (one behaviour, #66).
PNG_LIBRARY_MISSING = "reading PNG images needs libpng 1.6 (libpng16.so.16): apt install libpng16-16"
PNG_LIBRARY_OLD = "this libpng16 lacks the simplified API (libpng >= 1.6 is needed)"
JPEG_LIBRARY_MISSING = ("reading JPEG images needs libjpeg-turbo's TurboJPEG library (libturbojpeg.so.0): apt install "
                        "libturbojpeg0 (Debian) or libturbojpeg (Ubuntu, JetPack)")
JPEG_LIBRARY_OLD = "this libturbojpeg is too old (>= 1.5 is needed)"
_LIBRARIES = {}  # soname -> the library (ctypes.CDLL) or the line that refuses for want of it


def _library(names, functions, missing, old, required=True, prepare=None):
    """The first of ``names`` that dlopen finds, as edgeq-run's OpenLibrary looks for it (``prepare(lib)`` run once,
    when it is found); where none is found or it lacks one of ``functions``, ImageError with edgeq-run's own line
    (None if not ``required``)."""
    if names[0] not in _LIBRARIES:
        import ctypes

        found = missing
        for name in names:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            found = lib if all(hasattr(lib, f) for f in functions) else old
            break
        if prepare is not None and not isinstance(found, str):
            prepare(found)
        _LIBRARIES[names[0]] = found
    found = _LIBRARIES[names[0]]
    if isinstance(found, str):
        if not required:
            return None
        raise ImageError(found)
    return found


def _libpng():
    """libpng 1.6, which edgeq-run decodes PNGs with: checked for, so that run.py reads a PNG only where
    edgeq-run would (Pillow decodes it: the pixels are the same, libpng's conversions being refused first)."""
    return _library(("libpng16.so.16", "libpng16.so"), ("png_image_begin_read_from_memory", "png_image_finish_read",
                                                        "png_image_free"), PNG_LIBRARY_MISSING, PNG_LIBRARY_OLD)


def _turbojpeg(required=True):
    """libjpeg-turbo's TurboJPEG library, the one edgeq-run dlopens (image.h)."""
    return _library(("libturbojpeg.so.0", "libturbojpeg.so"), ("tjInitDecompress", "tjDecompressHeader3",
                                                               "tjDecompress2", "tjGetErrorStr2", "tjDestroy"),
                    JPEG_LIBRARY_MISSING, JPEG_LIBRARY_OLD, required, _turbojpeg_types)


def _turbojpeg_types(lib) -> None:
    import ctypes as c

    lib.tjInitDecompress.restype = c.c_void_p
    lib.tjDecompressHeader3.argtypes = [c.c_void_p, c.c_char_p, c.c_ulong] + [c.POINTER(c.c_int)] * 4
    lib.tjDecompress2.argtypes = [c.c_void_p, c.c_char_p, c.c_ulong, c.c_void_p] + [c.c_int] * 5
    lib.tjGetErrorStr2.argtypes, lib.tjGetErrorStr2.restype = [c.c_void_p], c.c_char_p
    lib.tjDestroy.argtypes = [c.c_void_p]


def decode_jpeg(np, lib, data: bytes, path: str, max_pixels: int = MAX_IMAGE_PIXELS):
    """A JPEG's pixels through libturbojpeg, as edgeq-run's image.h DecodeJpeg, call by call: the same library,
    the same flags (0: the accurate IDCT and fancy upsampling), the same refusals. One decoder for both loaders:
    Pillow's libjpeg goes on after some damage (extraneous bytes) that TurboJPEG refuses."""
    import ctypes

    tj = lib.tjInitDecompress()
    if not tj:
        raise ImageError("libturbojpeg could not start")
    try:
        w, h, subsampling, colorspace = (ctypes.c_int(0) for _ in range(4))
        if lib.tjDecompressHeader3(tj, data, len(data), ctypes.byref(w), ctypes.byref(h), ctypes.byref(subsampling),
                                   ctypes.byref(colorspace)) != 0:
            raise ImageError("cannot decode %s: %s" % (path, lib.tjGetErrorStr2(tj).decode("utf-8", "replace")))
        if colorspace.value in (3, 4):  # TJCS_CMYK, TJCS_YCCK
            raise ImageError("%s is a CMYK JPEG; give an 8-bit gray, RGB or RGBA PNG or JPEG" % path)
        if w.value <= 0 or h.value <= 0 or w.value * h.value > max_pixels:
            raise ImageError("%s has %d x %d pixels, more than %d" % (path, w.value, h.value, max_pixels))
        channels = 1 if colorspace.value == 2 else 3  # TJCS_GRAY: gray, as Pillow opens it
        pixels = np.zeros((h.value, w.value, channels), np.uint8)
        # TJPF_GRAY 6, TJPF_RGB 0
        if lib.tjDecompress2(tj, data, len(data), pixels.ctypes.data, w.value, 0, h.value, 6 if channels == 1 else 0, 0) != 0:
            raise ImageError("cannot decode %s: %s" % (path, lib.tjGetErrorStr2(tj).decode("utf-8", "replace")))
        return pixels
    finally:
        lib.tjDestroy(tj)


def decode_image(np, path: str, any_format: bool = False, max_pixels: int = MAX_IMAGE_PIXELS):
    """``path`` (PNG or JPEG; ``any_format``: whatever Pillow reads, for calibration) as uint8 pixels
    ``[H, W, C]``, C 1 (gray files) or 3 (everything else; alpha dropped, palettes expanded): a JPEG with
    libturbojpeg (``decode_jpeg``: edgeq-run's decoder), the rest with Pillow, else OpenCV. Where edgeq-run
    would find no libturbojpeg or libpng, refused with its line (``any_format``, the host's calibration images:
    Pillow reads them instead). 16-bit PNGs are refused (edgeq-run's libpng would gamma-convert them)."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):  # a FIFO with no writer would block the open
        raise ImageError("%s is not a regular file" % path)
    if info.st_size > MAX_IMAGE_FILE_BYTES:
        raise ImageError("%s is larger than %d bytes" % (path, MAX_IMAGE_FILE_BYTES))
    with open(path, "rb") as f:
        data = f.read(MAX_IMAGE_FILE_BYTES + 1)
    head = data[:32]
    png = head.startswith(PNG_MAGIC)
    if not any_format and not is_image(head):
        raise ImageError("%s is not a PNG or JPEG image" % path)
    if png and len(head) > 24 and head[24] == 16:
        raise ImageError("%s is a 16-bit PNG; give an 8-bit one" % path)
    if png:
        data = png_pixel_chunks(data, path)
    if head.startswith(JPEG_MAGIC):
        lib = _turbojpeg(required=not any_format)  # calibration on the host: Pillow reads it where it is missing
        if lib is not None:
            return decode_jpeg(np, lib, data, path, max_pixels)
    elif png and not any_format:
        _libpng()  # refused as edgeq-run refuses where libpng is missing
    try:
        from PIL import Image
    except ImportError:
        Image = None
    if Image is not None:
        Image.MAX_IMAGE_PIXELS = None  # the limit below applies, before any pixel is decoded
        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.width * image.height > max_pixels:
                    raise ImageError("%s has %d x %d pixels, more than %d" % (path, image.width, image.height, max_pixels))
                if image.mode in ("I", "I;16", "I;16B", "F", "CMYK"):
                    raise ImageError("%s is a %s image; give an 8-bit gray, RGB or RGBA PNG or JPEG" % (path, image.mode))
                gray = image.mode in ("L", "LA", "1")  # 1-bit gray: 0 and 255, as libpng expands it
                image = image.convert("L" if gray else "RGB")
                pixels = np.asarray(image, dtype=np.uint8)
        except (OSError, ValueError, SyntaxError) as err:
            if isinstance(err, ImageError):
                raise
            raise ImageError("cannot decode %s: %s" % (path, (str(err).splitlines() or [type(err).__name__])[0]))
        return pixels[:, :, None] if pixels.ndim == 2 else pixels
    try:
        import cv2
    except ImportError:
        raise ImageError("reading images needs Pillow or OpenCV: pip install pillow (or give NAME=FILE.npy)")
    pixels = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if pixels is None or pixels.dtype != np.uint8:
        raise ImageError("cannot decode %s as an 8-bit image" % path)
    if pixels.ndim == 2:
        return pixels[:, :, None]
    return np.ascontiguousarray(pixels[:, :, 2::-1] if pixels.shape[2] >= 3 else pixels[:, :, :1])


def _bilinear(np, pixels, height: int, width: int):
    """Bilinear resize with half-pixel centres (OpenCV's INTER_LINEAR; no antialiasing), in float32 in this
    order of operations (edgeq-run computes the same, operation by operation)."""
    def taps(size_in, size_out):
        pos = (np.arange(size_out, dtype=np.float64) + 0.5) * (size_in / size_out) - 0.5
        pos = np.clip(pos, 0.0, size_in - 1)
        low = np.floor(pos)
        weight = (pos - low).astype(np.float32)
        low = low.astype(np.int64)
        return low, np.minimum(low + 1, size_in - 1), weight

    y0, y1, wy = taps(pixels.shape[0], height)
    x0, x1, wx = taps(pixels.shape[1], width)
    wx, wy = wx[None, :, None], wy[:, None, None]
    one = np.float32(1.0)
    # the four taps gathered as uint8 (exact in float32), then the same float32 operations in the same order
    r0, r1 = pixels[y0], pixels[y1]
    top = r0[:, x0].astype(np.float32) * (one - wx) + r0[:, x1].astype(np.float32) * wx
    bottom = r1[:, x0].astype(np.float32) * (one - wx) + r1[:, x1].astype(np.float32) * wx
    top *= one - wy
    bottom *= wy
    top += bottom
    return top


def letterbox_geometry(height: int, width: int, image_h: int, image_w: int):
    """(scale, new_h, new_w, top, left) of ultralytics' letterbox: the image scaled to fit, centred."""
    scale = min(height / image_h, width / image_w)
    # at least one row and column (a 20000x1 image scales to 0.032 rows), centred by the rows it really takes
    new_h, new_w = max(1, int(round(image_h * scale))), max(1, int(round(image_w * scale)))
    top, left = int(round((height - new_h) / 2 - 0.1)), int(round((width - new_w) / 2 - 0.1))
    return scale, new_h, new_w, top, left


def image_tensor(np, pixels, pre):
    """The input tensor ``pre`` (a PreprocessRecord) makes of decoded ``pixels`` (uint8 [H, W, C]): channel
    order, resize, ``(p / scale - mean) / std`` in float32, layout, a batch of one."""
    if pre.order == "GRAY" and pixels.shape[2] == 3:  # ITU-R 601 luma, in Pillow's integer arithmetic
        p = pixels.astype(np.uint32)
        pixels = ((p[:, :, 0] * 19595 + p[:, :, 1] * 38470 + p[:, :, 2] * 7471 + 0x8000) >> 16).astype(np.uint8)[:, :, None]
    elif pre.order != "GRAY" and pixels.shape[2] == 1:
        pixels = np.repeat(pixels, 3, axis=2)
    if pre.order == "BGR":
        pixels = pixels[:, :, ::-1]
    if pre.resize == "letterbox":
        _, new_h, new_w, top, left = letterbox_geometry(pre.height, pre.width, pixels.shape[0], pixels.shape[1])
        out = np.full((pre.height, pre.width, pixels.shape[2]), PAD_VALUE, np.float32)
        out[top:top + new_h, left:left + new_w] = _bilinear(np, pixels, new_h, new_w)[: pre.height - top, : pre.width - left]
    else:
        out = _bilinear(np, pixels, pre.height, pre.width)
    # (p / scale - mean) / std in float32, in place; subtracting 0 and dividing by 1 change no float32 value
    out /= np.float32(pre.scale)
    mean, std = np.asarray(pre.mean, np.float32), np.asarray(pre.std, np.float32)
    if mean.any():
        out -= mean
    if (std != 1).any():
        out /= std
    out = out.transpose(2, 0, 1) if pre.layout == "NCHW" else out
    return np.ascontiguousarray(out[None], dtype=np.float32)


def classify(np, output, post) -> list:
    """Top-k of a classifier's output (``post``: a PostprocessRecord): [{index, score, label?}], scores by a
    softmax in float64 where the output is logits, rounded to 4 decimals (both loaders print the same)."""
    values = np.asarray(output, dtype=np.float64).reshape(-1)
    if post.softmax:
        e = np.exp(values - values.max())
        values = e / e.sum()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))[: post.top_k]
    top = []
    for i in order:
        row = {"index": int(i), "score": round(float(values[i]), 4)}
        if i < len(post.labels):
            row["label"] = post.labels[i]
        top.append(row)
    return top


def _unletterbox(pre, image_hw):
    """(scale_x, scale_y, left, top) taking input pixels back to the image's (ultralytics' scale_boxes)."""
    if pre is None or image_hw is None:
        return 1.0, 1.0, 0, 0
    if pre.resize == "letterbox":
        scale, _, _, top, left = letterbox_geometry(pre.height, pre.width, image_hw[0], image_hw[1])
        return scale, scale, left, top
    return pre.width / image_hw[1], pre.height / image_hw[0], 0, 0


def yolo_row_problem(row: int, c: int, b: int, classes: int, boxes: int) -> str:
    """A selected row naming a class or box the head does not have (edgeq-run says the same)."""
    return ("the model's selected row %d names class %d and box %d; its head has %d classes and %d boxes: the bundle "
            "is damaged" % (row, c, b, classes, boxes))


def yolo(np, outputs: dict, post, real: int, pre=None, image_hw=None) -> list:
    """The detections of a YOLO head whose NonMaxSuppression ran in the graph: [{box: [x1, y1, x2, y2],
    score, class, label?}], best first (equal scores: the earlier row), at most ``max_det``; boxes in the
    image's pixels (``image_hw``: (height, width) of the image the input was made from, undoing the letterbox
    or stretch of ``pre``), clipped to it, rounded to 0.01 px, scores to 4 decimals. ``real``: the selected
    rows that are real (TensorSpec.real_rows of ``post.selected``)."""
    head = np.asarray(outputs[post.output])
    head = head.reshape(head.shape[-2], head.shape[-1])  # [4 + classes (+ masks), anchors]
    rows = np.asarray(outputs[post.selected])
    found = []
    for r in range(real):
        c, b = int(rows[r, 1]), int(rows[r, 2])
        if not (0 <= c < head.shape[0] - 4 and 0 <= b < head.shape[1]):
            raise ImageError(yolo_row_problem(r, c, b, head.shape[0] - 4, head.shape[1]))
        found.append((float(head[4 + c, b]), r, c, b))
    found.sort(key=lambda t: (-t[0], t[1]))
    sx, sy, left, top = _unletterbox(pre, image_hw)
    detections = []
    for score, _, c, b in found[: post.max_det]:
        cx, cy, w, h = (float(head[k, b]) for k in range(4))
        box = [(cx - w / 2 - left) / sx, (cy - h / 2 - top) / sy, (cx + w / 2 - left) / sx, (cy + h / 2 - top) / sy]
        if image_hw is not None:
            box = [min(max(v, 0.0), float(image_hw[1 - k % 2])) for k, v in enumerate(box)]
        row = {"box": [round(v, 2) for v in box], "score": round(score, 4), "class": c}
        if c < len(post.labels):
            row["label"] = post.labels[c]
        detections.append(row)
    return detections


def describe_detections(detections: list) -> str:
    """yolo's rows as text: label (class), score, box."""
    if not detections:
        return "no detections"
    return "\n".join("%-16s %.4f  [%s]" % (row.get("label", "class %d" % row["class"]), row["score"],
                                           ", ".join("%.2f" % v for v in row["box"])) for row in detections)


def describe_top(top: list) -> str:
    """classify's rows as text: rank, score, label (index)."""
    return "\n".join("%2d. %.4f  %s" % (rank, row["score"], "%s (%d)" % (row["label"], row["index"]) if "label" in row
                                          else "class %d" % row["index"]) for rank, row in enumerate(top, 1))


# box colours by class (ultralytics' palette), RGB
BOX_COLOURS = ((255, 56, 56), (255, 157, 151), (255, 112, 31), (255, 178, 29), (207, 210, 49), (72, 249, 10),
               (146, 204, 23), (61, 219, 134), (26, 147, 52), (0, 212, 187), (44, 153, 168), (0, 194, 255),
               (52, 69, 147), (100, 115, 255), (0, 24, 236), (132, 56, 255), (82, 0, 133), (203, 56, 255),
               (255, 149, 200), (255, 55, 199))
BOX_LINE = 2  # pixels


def box_pixels(box, height: int, width: int):
    """(x1, y1, x2, y2) inclusive pixel bounds of a detection's box [x1, y1, x2, y2] (image pixels, floats)."""
    x1, y1 = int(max(0, min(width - 1, box[0] // 1))), int(max(0, min(height - 1, box[1] // 1)))
    x2, y2 = int(max(0, min(width - 1, box[2] // 1))), int(max(0, min(height - 1, box[3] // 1)))
    return x1, y1, max(x1, x2), max(y1, y2)


# Labels are drawn in PIL's bitmap font (ImageFont.load_default_imagefont()): ASCII 32-126, FONT_H rows of FONT_W
# pixels each, a row's pixels in the low FONT_W bits of its byte, leftmost first. edgeq-run draws from the same
# table (contract.h, generated from this one).
FONT_W, FONT_H = 6, 11
FONT_HEX = (
    "000000000000000000000000000018181818001800000000001414140000000000000014143e14143e14140000081e323c1e0636"
    "3c08000000382a3c081e2a0e00000000001c30183e2c3e000000000c08100000000000000000040818181818080400000010080c"
    "0c0c0c0810000000083c1824000000000000000008083e080800000000000000000000000c081000000000003e00000000000000"
    "000000000000180000000002020404080810100000001c36363636361c000000000c3c0c0c0c0c3f000000001c36060c18363e00"
    "0000001c36061c06361c00000000060e16363f0606000000003e303c3606263c000000001c36303c36361c000000003e36060c0c"
    "1818000000001c36361c36361c000000001c36361e06361c0000000000000018000018000000000000001800001810200000000c"
    "1830180c000000000000003c003c00000000000000180c060c180000000000001c260c180018000000001c32262a2a27301c0000"
    "00003c1c143e363700000000003c363c36363c00000000001e363030361c00000000003c363636363c00000000003e303c30363e"
    "00000000003e303c30303800000000001c36303e361e000000000037363e36363700000000003c181818183c00000000001e0c0c"
    "2c2c3800000000003634383c363b000000000038303030363e00000000002236363e2a2a0000000000373a3a3636320000000000"
    "1c363636361c00000000003c36363c303800000000001c363636361c06000000003c36363c363b00000000001e323c0e263c0000"
    "0000003e1a1818183c000000000037363636361c00000000003736141c1c0800000000002b2a2a3e1c140000000000331e0c0c1e"
    "33000000000033331e0c0c1e00000000003e360c18363e000000001c1818181818181c00000020201010080804040000001c0c0c"
    "0c0c0c0c1c000000081c36000000000000000000000000000000003f0000180804000000000000000000001c361e363f00000000"
    "30303c3636363c0000000000001c3630361c000000000e061e3636361f0000000000001c363e301e000000000e183e1818183e00"
    "00000000001b3636361e063c000030303c36363636000000000c003c0c0c0c3f000000000c003c0c0c0c0c0c3800003030363c38"
    "3c37000000003c0c0c0c0c0c3f0000000000003c3e2a2a2a0000000000002c363636360000000000001c3636361c000000000000"
    "3c3636363c3038000000001b3636361e060f00000000371d18183c0000000000001e381e073e0000000018183e18181b0e000000"
    "000000363636361f00000000000036361c1c080000000000002b2a3e1e140000000000003b1e0c1e37000000000000373636141c"
    "1830000000003e2c18363e00000000060c0c180c0c0c0600000000080808080808080000003018180c1818183000000000001a2c"
    "0000000000"
)
FONT = bytes.fromhex(FONT_HEX)
TEXT_COLOUR = (255, 255, 255)


def label_text(row: dict) -> str:
    """What is written above a detection's box: its label (or class N) and score, printable ASCII only."""
    text = "%s %.2f" % (row.get("label", "class %d" % row["class"]), row["score"])
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def draw_text(np, out, x: int, y: int, text: str, colour) -> None:
    """``text`` into ``out`` (uint8 [H, W, 3]) with its top-left corner at (x, y), clipped to the image."""
    if not text:
        return
    codes = np.frombuffer(text.encode("ascii"), np.uint8).astype(np.int64) - 32
    rows = np.frombuffer(FONT, np.uint8).reshape(-1, FONT_H)[codes]  # [chars, FONT_H]
    bits = (rows[:, :, None] >> np.arange(FONT_W - 1, -1, -1)) & 1  # [chars, FONT_H, FONT_W]
    mask = bits.transpose(1, 0, 2).reshape(FONT_H, len(text) * FONT_W).astype(bool)
    h, w = out.shape[:2]
    y0, x0 = max(y, 0), max(x, 0)
    y1, x1 = min(y + FONT_H, h), min(x + mask.shape[1], w)
    if y0 < y1 and x0 < x1:
        region = out[y0:y1, x0:x1]
        region[mask[y0 - y:y1 - y, x0 - x:x1 - x]] = colour


def draw_detections(np, pixels, detections: list):
    """A copy of ``pixels`` (uint8 [H, W, C]) with each detection's box outlined, BOX_LINE pixels inside the box, in
    its class's colour, and its label and score written on a bar of that colour above the box (inside it where the
    box touches the top), worst first so the best is on top (edgeq-run's DrawDetections draws the same pixels)."""
    out = np.array(pixels if pixels.shape[2] == 3 else np.repeat(pixels[:, :, :1], 3, axis=2), np.uint8)
    h, w = out.shape[:2]
    for row in reversed(detections):
        colour = np.asarray(BOX_COLOURS[row["class"] % len(BOX_COLOURS)], np.uint8)
        x1, y1, x2, y2 = box_pixels(row["box"], h, w)
        t = BOX_LINE
        out[y1:min(y1 + t, y2 + 1), x1:x2 + 1] = colour
        out[max(y2 - t + 1, y1):y2 + 1, x1:x2 + 1] = colour
        out[y1:y2 + 1, x1:min(x1 + t, x2 + 1)] = colour
        out[y1:y2 + 1, max(x2 - t + 1, x1):x2 + 1] = colour
        text = label_text(row)
        bar_h, bar_w = FONT_H + 2, len(text) * FONT_W + 2
        top = y1 - bar_h if y1 >= bar_h else y1
        out[top:min(top + bar_h, h), x1:min(x1 + bar_w, w)] = colour
        draw_text(np, out, x1 + 1, top + 1, text, TEXT_COLOUR)
    return out
