"""Video in: what ``run.py --input SOURCE`` reads from a video file, a V4L2 camera, a CSI camera, an RTSP
stream or a GStreamer pipeline of the user's own, frame by frame, as RGB pixels that go through the image
path's exact preprocessing (``imaging.image_tensor``). Shipped in every bundle beside run.py.

GStreamer is reached through ctypes (``libgstreamer-1.0.so.0``, ``libgstapp-1.0.so.0``), as edgeq-run
dlopens the same two libraries (``native/video.h``): both loaders build the same pipeline description,
ask the same ``appsink`` for the same caps (``video/x-raw,format=RGB``) and so get the same frames, with
nothing installed beyond what JetPack (or a desktop's GStreamer) ships. Neither OpenCV nor PyGObject is
needed. On a Jetson the sources use NVIDIA's elements where GStreamer has them (``nvarguscamerasrc`` for
CSI, ``nvvidconv`` for the colour conversion out of NVMM memory; ``decodebin`` picks ``nvv4l2decoder`` by its
rank); elsewhere ``decodebin`` and ``videoconvert``.

Importing this module needs only the standard library; numpy comes in as an argument.
"""

import ctypes
import os
import re
import time

VIDEO_SUFFIXES = (".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v", ".ts")
SINK_NAME = "edgeq_sink"
RGB_CAPS = "video/x-raw,format=RGB"
DEFAULT_TIMEOUT_S = 10.0  # --timeout: a source that delivers no frame for this long ends the run
MAX_FRAME_PIXELS = 50_000_000  # imaging.MAX_IMAGE_PIXELS: one frame

# GStreamer's ABI (1.x, stable): enum values and the offsets of the fields read here
GST_STATE_NULL, GST_STATE_PAUSED, GST_STATE_PLAYING = 1, 3, 4
GST_STATE_CHANGE_FAILURE, GST_STATE_CHANGE_NO_PREROLL = 0, 3
GST_MESSAGE_EOS, GST_MESSAGE_ERROR = 1 << 0, 1 << 1
GST_MAP_READ = 1
GST_CLOCK_TIME_NONE = (1 << 64) - 1
BUFFER_PTS_OFFSET = 72  # GstBuffer: GstMiniObject (64 bytes) + GstBufferPool* -> pts
MAP_INFO_BYTES = 256  # GstMapInfo is 104 bytes on 64-bit machines: room to spare
MAP_DATA_OFFSET, MAP_SIZE_OFFSET = 16, 24  # GstMapInfo: GstMemory*, GstMapFlags (+pad), guint8* data, gsize size
GERROR_MESSAGE_OFFSET = 8  # GError: GQuark domain, gint code, gchar* message
MESSAGE_TYPE_OFFSET = 64  # GstMessage: GstMiniObject (64 bytes), then GstMessageType type


class VideoError(Exception):
    """A source that cannot be opened or read: the one-line reason."""


def is_stream(spec: str) -> bool:
    """Whether an ``--input`` names a video source rather than a tensor or an image."""
    if spec.startswith(("gst:", "csi://", "rtsp://", "rtsps://")):
        return True
    if re.fullmatch(r"/dev/video\d+", spec):
        return True
    return spec.lower().endswith(VIDEO_SUFFIXES)


SCHEMES = ("gst:", "csi://", "rtsp://", "rtsps://", "/dev/video")


def stream_input(spec: str):
    """(input name or None, source) where an ``--input`` names a video source, else None: a source with a scheme
    (gst:, csi://, rtsp://, /dev/video) is the whole argument (a pipeline has '=' of its own); otherwise NAME=FILE
    or FILE, a file whose name ends in a video suffix."""
    if spec.startswith(SCHEMES):
        return (None, spec) if is_stream(spec) else None
    name, sep, path = spec.partition("=")
    if sep and path.startswith(SCHEMES):
        return (name or None, path) if is_stream(path) else None
    if sep and is_stream(path):
        return name or None, path
    return (None, spec) if not sep and is_stream(spec) else None


def quote(text: str) -> str:
    """A value for gst_parse_launch: double-quoted, backslash and quote escaped."""
    return '"%s"' % text.replace("\\", "\\\\").replace('"', '\\"')


def describe(spec, have):
    """(pipeline description ending in the edgeq appsink, a short name of the source) for an ``--input``;
    ``have(element)``: whether GStreamer has that element factory. Raises VideoError for a source that
    cannot be (no such file or camera, a CSI camera where there is no nvarguscamerasrc)."""
    sink = "appsink name=%s sync=false max-buffers=2 drop=false caps=%s" % (SINK_NAME, RGB_CAPS)
    # out of NVIDIA's NVMM memory (decoders, CSI) into RGB: nvvidconv where it is, then videoconvert
    convert = "nvvidconv ! video/x-raw,format=BGRx ! videoconvert" if have("nvvidconv") else "videoconvert"
    if spec.startswith("gst:"):
        user = spec[4:].strip()
        last = user.rsplit("!", 1)[-1].strip()
        if not user or not re.match(r"appsink(\s|$)", last):
            raise VideoError("--input gst:PIPELINE must end in appsink (... ! videoconvert ! appsink)")
        named = re.search(r"\bname=(\"[^\"]*\"|\S+)", last)
        if named:
            raise VideoError("--input gst:...: leave the appsink unnamed; edgeq names it %s" % SINK_NAME)
        head = user[: len(user) - len(last)]
        # edgeq's name and RGB caps first: what the user set after them stands, and a format other than RGB is refused
        return head + "appsink name=%s caps=%s" % (SINK_NAME, RGB_CAPS) + last[len("appsink"):], "gst pipeline"
    if spec.startswith("csi://"):
        sensor = spec[len("csi://"):]
        if not sensor.isdigit():
            raise VideoError("--input %s: a CSI camera is csi://N (N: the sensor, 0 for the first)" % spec)
        if not have("nvarguscamerasrc"):
            raise VideoError("--input %s needs NVIDIA's nvarguscamerasrc (JetPack's GStreamer); it is not on this "
                             "machine" % spec)
        return ("nvarguscamerasrc sensor-id=%s ! video/x-raw(memory:NVMM) ! %s ! %s" % (sensor, convert, sink),
                "CSI camera %s" % sensor)
    if spec.startswith(("rtsp://", "rtsps://")):
        shown = re.sub(r"^(\w+://)[^/@]*@", r"\1", spec)  # without user:password
        return "uridecodebin uri=%s ! %s ! %s" % (quote(spec), convert, sink), shown
    if spec.startswith("/dev/video"):
        if not os.path.exists(spec):
            raise VideoError("--input %s: there is no such camera (see ls /dev/video*)" % spec)
        return "v4l2src device=%s ! decodebin ! %s ! %s" % (quote(spec), convert, sink), "camera %s" % spec
    if not os.path.exists(spec):
        raise VideoError("--input %s: no such file" % spec)
    if not os.path.isfile(spec):
        raise VideoError("--input %s is not a regular file" % spec)
    return "filesrc location=%s ! decodebin ! %s ! %s" % (quote(spec), convert, sink), os.path.basename(spec)


class _Gst:
    """The GStreamer functions used here, from the system's libraries."""

    def __init__(self):
        c = ctypes
        try:
            gst = c.CDLL("libgstreamer-1.0.so.0")
            app = c.CDLL("libgstapp-1.0.so.0")
            glib = c.CDLL("libglib-2.0.so.0")
        except OSError:
            raise VideoError("reading video needs GStreamer (libgstreamer-1.0.so.0 and libgstapp-1.0.so.0): on Debian "
                             "or Ubuntu apt install gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-libav; "
                             "JetPack ships it")
        p, vp = c.c_void_p, c.c_void_p
        sig = {
            (gst, "gst_init_check"): (c.c_int, [p, p, p]),
            (gst, "gst_parse_launch"): (vp, [c.c_char_p, c.POINTER(p)]),
            (gst, "gst_bin_get_by_name"): (vp, [p, c.c_char_p]),
            (gst, "gst_element_set_state"): (c.c_int, [p, c.c_int]),
            (gst, "gst_element_get_bus"): (vp, [p]),
            (gst, "gst_bus_pop_filtered"): (vp, [p, c.c_int]),
            (gst, "gst_message_parse_error"): (None, [p, c.POINTER(p), c.POINTER(p)]),
            (gst, "gst_object_unref"): (None, [p]),
            (gst, "gst_mini_object_unref"): (None, [p]),
            (gst, "gst_element_factory_find"): (vp, [c.c_char_p]),
            (gst, "gst_sample_get_buffer"): (vp, [p]),
            (gst, "gst_sample_get_caps"): (vp, [p]),
            (gst, "gst_caps_get_structure"): (vp, [p, c.c_uint]),
            (gst, "gst_structure_get_int"): (c.c_int, [p, c.c_char_p, c.POINTER(c.c_int)]),
            (gst, "gst_structure_get_string"): (c.c_char_p, [p, c.c_char_p]),
            (gst, "gst_buffer_map"): (c.c_int, [p, p, c.c_int]),
            (gst, "gst_buffer_unmap"): (None, [p, p]),
            (gst, "gst_structure_get_fraction"): (c.c_int, [p, c.c_char_p, c.POINTER(c.c_int), c.POINTER(c.c_int)]),
            (gst, "gst_bus_timed_pop_filtered"): (vp, [p, c.c_uint64, c.c_int]),
            (gst, "gst_buffer_new_allocate"): (vp, [p, c.c_size_t, p]),
            (gst, "gst_buffer_fill"): (c.c_size_t, [p, c.c_size_t, p, c.c_size_t]),
            (app, "gst_app_src_push_buffer"): (c.c_int, [p, p]),
            (app, "gst_app_src_end_of_stream"): (c.c_int, [p]),
            (app, "gst_app_sink_try_pull_sample"): (vp, [p, c.c_uint64]),
            (app, "gst_app_sink_is_eos"): (c.c_int, [p]),
            (glib, "g_error_free"): (None, [p]),
            (glib, "g_free"): (None, [p]),
        }
        for (lib, name), (restype, argtypes) in sig.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise VideoError("the GStreamer here has no %s; it needs GStreamer 1.10 or newer" % name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name, fn)
        if not self.gst_init_check(None, None, None):
            raise VideoError("GStreamer could not start (gst_init_check failed)")

    def have(self, element: str) -> bool:
        factory = self.gst_element_factory_find(element.encode())
        if factory:
            self.gst_object_unref(factory)
        return bool(factory)

    def error_text(self, error_ptr) -> str:
        """The message of a GError*, and the GError freed."""
        message = ctypes.c_char_p.from_address(error_ptr + GERROR_MESSAGE_OFFSET).value or b"unknown error"
        self.g_error_free(error_ptr)
        return message.decode("utf-8", "replace").splitlines()[0] if message.strip() else "unknown error"


_GST = []


def gstreamer() -> "_Gst":
    if not _GST:
        _GST.append(_Gst())
    return _GST[0]


class Source:
    """An open video source: ``read()`` gives (pixels uint8 [H, W, 3], timestamp in seconds or None) per frame and
    None at the end; ``live``: whether the source runs on its own clock (a camera, a stream: frames are dropped
    when the model falls behind) rather than being read as fast as the model takes it (a file)."""

    def __init__(self, spec: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.spec, self.timeout = spec, timeout
        self.gst = gst = gstreamer()
        self.description, self.name = describe(spec, gst.have)
        self.pipeline = self.sink = self.bus = None
        self.frames = 0
        self.cancel = False  # set by another thread: read() returns None at its next 0.1 s step
        self.rate = None  # (numerator, denominator) frames per second where the source says
        error = ctypes.c_void_p()
        pipeline = gst.gst_parse_launch(self.description.encode(), ctypes.byref(error))
        if error.value:
            text = gst.error_text(error.value)
            if pipeline:
                gst.gst_object_unref(pipeline)
            raise VideoError("--input %s: GStreamer cannot make the pipeline: %s" % (spec, text))
        if not pipeline:
            raise VideoError("--input %s: GStreamer cannot make the pipeline" % spec)
        self.pipeline = pipeline
        self.sink = gst.gst_bin_get_by_name(pipeline, SINK_NAME.encode())
        if not self.sink:
            self.close()
            raise VideoError("--input %s: the pipeline has no appsink" % spec)
        self.bus = gst.gst_element_get_bus(pipeline)
        # PAUSED first: a live source says so there (it cannot preroll), then PLAYING
        paused = gst.gst_element_set_state(pipeline, GST_STATE_PAUSED)
        state = gst.gst_element_set_state(pipeline, GST_STATE_PLAYING) if paused != GST_STATE_CHANGE_FAILURE else paused
        if state == GST_STATE_CHANGE_FAILURE:
            problem = self._bus_error() or "it would not start"
            self.close()
            raise VideoError("--input %s: %s" % (spec, problem))
        self.live = paused == GST_STATE_CHANGE_NO_PREROLL

    def _bus_error(self):
        """The first error GStreamer posted, as a line, or None."""
        message = self.gst.gst_bus_pop_filtered(self.bus, GST_MESSAGE_ERROR) if self.bus else None
        return _message_error(self.gst, message) if message else None

    def read(self, np):
        """The next frame: (pixels [H, W, 3] uint8, seconds or None), or None at the end of the source."""
        gst = self.gst
        waited = 0.0
        step = 0.1
        while True:
            sample = gst.gst_app_sink_try_pull_sample(self.sink, int(step * 1e9))
            if sample:
                break
            problem = self._bus_error()
            if problem:
                if not self.frames:
                    raise VideoError("cannot read %s: %s" % (self.name, problem))
                raise VideoError("%s stopped after %d frames: %s" % (self.name, self.frames, problem))
            if gst.gst_app_sink_is_eos(self.sink) or self.cancel:
                return None
            waited += step
            if waited >= self.timeout:
                raise VideoError("%s delivered no frame for %g s (--timeout)" % (self.name, self.timeout))
        try:
            return self._pixels(np, sample)
        finally:
            gst.gst_mini_object_unref(sample)

    def _pixels(self, np, sample):
        gst = self.gst
        structure = gst.gst_caps_get_structure(gst.gst_sample_get_caps(sample), 0)
        width, height = ctypes.c_int(0), ctypes.c_int(0)
        if not (structure and gst.gst_structure_get_int(structure, b"width", ctypes.byref(width))
                and gst.gst_structure_get_int(structure, b"height", ctypes.byref(height))):
            raise VideoError("%s: a frame without its size" % self.name)
        w, h = width.value, height.value
        num, den = ctypes.c_int(0), ctypes.c_int(0)
        if self.rate is None and gst.gst_structure_get_fraction(structure, b"framerate", ctypes.byref(num), ctypes.byref(den)):
            self.rate = (num.value, den.value) if num.value > 0 and den.value > 0 else None
        fmt = gst.gst_structure_get_string(structure, b"format")
        if fmt != b"RGB":
            raise VideoError("%s gives %s frames; the appsink must take %s" % (
                self.name, (fmt or b"unknown").decode("utf-8", "replace"), RGB_CAPS))
        if w <= 0 or h <= 0 or w * h > MAX_FRAME_PIXELS:
            raise VideoError("%s: a frame of %d x %d pixels" % (self.name, w, h))
        buffer = gst.gst_sample_get_buffer(sample)
        info = ctypes.create_string_buffer(MAP_INFO_BYTES)
        if not gst.gst_buffer_map(buffer, info, GST_MAP_READ):
            raise VideoError("%s: a frame that cannot be read" % self.name)
        try:
            base = ctypes.addressof(info)
            data = ctypes.c_void_p.from_address(base + MAP_DATA_OFFSET).value
            size = ctypes.c_size_t.from_address(base + MAP_SIZE_OFFSET).value
            stride = (w * 3 + 3) & ~3  # GStreamer's RGB rows: each starts on 4 bytes
            if size < stride * (h - 1) + w * 3:
                raise VideoError("%s: a frame of %d bytes for %d x %d RGB" % (self.name, size, w, h))
            raw = np.frombuffer(ctypes.string_at(data, stride * (h - 1) + w * 3) + b"\0" * (stride - w * 3), np.uint8)
            pixels = np.ascontiguousarray(raw.reshape(h, stride)[:, : w * 3].reshape(h, w, 3))
        finally:
            gst.gst_buffer_unmap(buffer, info)
        pts = ctypes.c_uint64.from_address(buffer + BUFFER_PTS_OFFSET).value
        self.frames += 1
        return pixels, (None if pts == GST_CLOCK_TIME_NONE else pts / 1e9)

    def close(self):
        _release(self.gst, self.pipeline, self.sink, self.bus)
        self.pipeline = self.sink = self.bus = None


VIDEO_MUXERS = {".mp4": "mp4mux", ".m4v": "mp4mux", ".mov": "qtmux", ".mkv": "matroskamux", ".avi": "avimux"}
SRC_NAME = "edgeq_src"
WRITE_TIMEOUT_S = 60.0  # the encoder's end of stream after the last frame


def encoder(path, have):
    """The GStreamer elements that encode RGB frames for ``path`` (its suffix picks the container): MJPEG in an AVI;
    otherwise H.264 by NVIDIA's nvv4l2h264enc (a Jetson) or x264enc, else MPEG-4 part 2 by libav's avenc_mpeg4."""
    suffix = os.path.splitext(path)[1].lower()
    mux = VIDEO_MUXERS.get(suffix)
    if mux is None:
        raise VideoError("--output %s: a video is written as %s, or frames as PNG into a folder (DIR/)"
                         % (path, ", ".join(sorted(VIDEO_MUXERS))))
    if suffix == ".avi":
        chain = "videoconvert ! jpegenc"
    elif have("nvv4l2h264enc"):
        chain = "nvvidconv ! video/x-raw(memory:NVMM),format=NV12 ! nvv4l2h264enc ! h264parse"
    elif have("x264enc"):
        chain = "videoconvert ! x264enc speed-preset=veryfast"
    elif have("avenc_mpeg4"):
        chain = "videoconvert ! avenc_mpeg4 bitrate=4000000"
    else:
        raise VideoError("--output %s needs an H.264 or MPEG-4 encoder in GStreamer (x264enc: gstreamer1.0-plugins-ugly; "
                         "avenc_mpeg4: gstreamer1.0-libav), or give .avi (MJPEG)" % path)
    for element in (mux, "jpegenc" if suffix == ".avi" else None):
        if element and not have(element):
            raise VideoError("--output %s needs GStreamer's %s (gstreamer1.0-plugins-good)" % (path, element))
    return "%s ! %s" % (chain, mux)


class Writer:
    """A video file written frame by frame through GStreamer (``appsrc`` -> encoder -> muxer -> a temporary file
    beside ``path``, renamed over it once the muxer has finished): ``write(pixels, seconds)``, then ``close()`` keeps
    it or ``discard()`` removes it."""

    def __init__(self, path, have):
        self.path, self.chain = path, encoder(path, have)
        self.tmp = "%s.tmp%d%s" % (path, os.getpid(), os.path.splitext(path)[1])
        self.gst = gstreamer()
        self.pipeline = self.src = self.bus = None
        self.size = self.start = None
        self.frames = 0

    def _open(self, width, height, rate):
        gst = self.gst
        num, den = rate or (30, 1)
        description = ("appsrc name=%s format=time block=true caps=video/x-raw,format=RGB,width=%d,height=%d,"
                       "framerate=%d/%d ! %s ! filesink location=%s" % (SRC_NAME, width, height, num, den, self.chain,
                                                                         quote(self.tmp)))
        error = ctypes.c_void_p()
        pipeline = gst.gst_parse_launch(description.encode(), ctypes.byref(error))
        if error.value or not pipeline:
            text = gst.error_text(error.value) if error.value else "unknown error"
            if pipeline:
                gst.gst_object_unref(pipeline)
            raise VideoError("cannot write %s: %s" % (self.path, text))
        self.pipeline = pipeline
        self.src = gst.gst_bin_get_by_name(pipeline, SRC_NAME.encode())
        self.bus = gst.gst_element_get_bus(pipeline)
        self.size, self.period = (width, height), den / num
        if gst.gst_element_set_state(pipeline, GST_STATE_PLAYING) == GST_STATE_CHANGE_FAILURE:
            raise VideoError("cannot write %s: %s" % (self.path, self._error() or "the encoder would not start"))

    def _error(self):
        message = self.gst.gst_bus_pop_filtered(self.bus, GST_MESSAGE_ERROR) if self.bus else None
        return _message_error(self.gst, message) if message else None

    def write(self, np, pixels, seconds, rate):
        """One frame (uint8 [H, W, 3]) at ``seconds`` (the source's timestamp, or None: one frame period after the
        last); ``rate``: the source's frames per second, for the container."""
        h, w = pixels.shape[:2]
        if self.pipeline is None:
            self._open(w, h, rate)
        elif (w, h) != self.size:
            raise VideoError("cannot write %s: the frames changed size (%d x %d to %d x %d)" % (self.path, *self.size, w, h))
        stride = (w * 3 + 3) & ~3
        data = np.zeros((h, stride), np.uint8)
        data[:, : w * 3] = pixels.reshape(h, w * 3)
        gst = self.gst
        buffer = gst.gst_buffer_new_allocate(None, data.nbytes, None)
        gst.gst_buffer_fill(buffer, 0, data.ctypes.data, data.nbytes)
        if seconds is None or self.start is None and self.frames:
            at = self.frames * self.period
        else:
            self.start = seconds if self.start is None else self.start
            at = max(seconds - self.start, 0.0)
        ctypes.c_uint64.from_address(buffer + BUFFER_PTS_OFFSET).value = int(round(at * 1e9))
        ctypes.c_uint64.from_address(buffer + BUFFER_PTS_OFFSET + 16).value = int(round(self.period * 1e9))  # duration
        if gst.gst_app_src_push_buffer(self.src, buffer) != 0:  # GST_FLOW_OK; the buffer is appsrc's now
            raise VideoError("cannot write %s: %s" % (self.path, self._error() or "the encoder stopped"))
        self.frames += 1

    def close(self):
        """The end of the stream: wait for the muxer to finish, then rename the file into place."""
        gst = self.gst
        if self.pipeline is None:
            return
        gst.gst_app_src_end_of_stream(self.src)
        message = gst.gst_bus_timed_pop_filtered(self.bus, int(WRITE_TIMEOUT_S * 1e9), GST_MESSAGE_EOS | GST_MESSAGE_ERROR)
        problem = _message_error(gst, message) if message else "the encoder did not finish in %g s" % WRITE_TIMEOUT_S
        self._stop()
        if problem:
            self.discard()
            raise VideoError("cannot write %s: %s" % (self.path, problem))
        try:
            os.replace(self.tmp, self.path)
        except OSError as err:
            self.discard()
            raise VideoError("cannot write %s: %s" % (self.path, err.strerror or err))

    def _stop(self):
        _release(self.gst, self.pipeline, self.src, self.bus)
        self.pipeline = self.src = self.bus = None

    def discard(self):
        self._stop()
        if os.path.lexists(self.tmp) and not os.path.islink(self.tmp):
            os.unlink(self.tmp)


def _release(gst, pipeline, *elements):
    """A pipeline stopped (NULL state), and it and its elements and bus released."""
    if pipeline:
        gst.gst_element_set_state(pipeline, GST_STATE_NULL)
    for obj in (*elements, pipeline):
        if obj:
            gst.gst_object_unref(obj)


def _message_error(gst, message):
    """The error line of a bus message (None for end of stream), the message released."""
    error, debug = ctypes.c_void_p(), ctypes.c_void_p()
    kind = ctypes.c_int.from_address(message + MESSAGE_TYPE_OFFSET).value
    text = None
    if kind == GST_MESSAGE_ERROR:
        gst.gst_message_parse_error(message, ctypes.byref(error), ctypes.byref(debug))
        text = explain(gst.error_text(error.value) if error.value else "unknown error")
        if debug.value:
            gst.g_free(debug.value)
    gst.gst_mini_object_unref(message)
    return text


def explain(text: str) -> str:
    """GStreamer's error line, with what to do where it is a known case."""
    if "missing a plug-in" in text or "no suitable plugins" in text.lower():
        return text + " (no decoder for this codec: install gstreamer1.0-libav or the plugins-good/-bad/-ugly sets)"
    if "busy" in text.lower():
        return text + " (another program has the camera open)"
    return text


class StageTimes:
    """Seconds per stage per frame; ``summary()``: p50/p99 in milliseconds (numpy.percentile's linear rule)."""

    STAGES = ("decode", "preprocess", "infer", "postprocess")

    def __init__(self):
        self.samples = {stage: [] for stage in self.STAGES}

    def add(self, stage: str, seconds: float):
        self.samples[stage].append(seconds)

    def summary(self, percentile) -> dict:
        """``percentile(sorted values, q)``: contract.percentile, as the latency statistics use it."""
        out = {}
        for stage, values in self.samples.items():
            if values:
                ordered = sorted(values)
                out[stage] = {"p50_ms": round(percentile(ordered, 50) * 1e3, 3),
                              "p99_ms": round(percentile(ordered, 99) * 1e3, 3)}
        return out


def describe_summary(summary: dict) -> str:
    """The end-of-run lines: frames, frames per second, drops, per-stage p50/p99."""
    lines = ["%d frames in %.2f s: %.1f frames/s, %d dropped%s" % (
        summary["frames"], summary["seconds"], summary["fps"], summary["dropped"],
        "" if not summary.get("stopped") else " (%s)" % summary["stopped"])]
    for stage, row in summary["stages"].items():
        lines.append("  %-12s p50 %8.3f ms  p99 %8.3f ms" % (stage, row["p50_ms"], row["p99_ms"]))
    return "\n".join(lines)


def now() -> float:
    return time.perf_counter()
