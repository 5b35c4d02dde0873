// video.h: edgeq-run --input VIDEO|/dev/videoN|csi://N|rtsp://...|gst:PIPELINE, as templates/video.py defines it
// (is_stream, describe, Source): the system's GStreamer (libgstreamer-1.0.so.0, libgstapp-1.0.so.0), dlopen'ed as
// libpng and libturbojpeg are; nothing is linked at build time. The same pipeline description as run.py's, the
// same appsink caps (video/x-raw,format=RGB), so both loaders get the same frames.
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit).
#pragma once

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "image.h"
#include "refuse.h"

namespace {

constexpr const char* kSinkName = "edgeq_sink";
constexpr const char* kRgbCaps = "video/x-raw,format=RGB";
// GStreamer's ABI (1.x, stable): enum values and the offsets of the fields read here (video.py: the same)
constexpr int kGstStateNull = 1, kGstStatePaused = 3, kGstStatePlaying = 4;
constexpr int kGstStateChangeFailure = 0, kGstStateChangeNoPreroll = 3;
constexpr int kGstMessageEos = 1 << 0, kGstMessageError = 1 << 1;
constexpr int kGstMapRead = 1;
constexpr uint64_t kGstClockTimeNone = ~uint64_t(0);
constexpr size_t kBufferPtsOffset = 72, kMapInfoBytes = 256, kMapDataOffset = 16, kMapSizeOffset = 24;
constexpr size_t kGErrorMessageOffset = 8, kMessageTypeOffset = 64;

// A source that fails while it is read (video.py's VideoError raised by Source.read): ends the run with kSource.
struct VideoFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct GstApi {
  int (*init_check)(void*, void*, void*) = nullptr;
  void* (*parse_launch)(const char*, void**) = nullptr;
  void* (*bin_get_by_name)(void*, const char*) = nullptr;
  int (*set_state)(void*, int) = nullptr;
  void* (*get_bus)(void*) = nullptr;
  void* (*bus_pop_filtered)(void*, int) = nullptr;
  void (*message_parse_error)(void*, void**, char**) = nullptr;
  void (*object_unref)(void*) = nullptr;
  void (*mini_object_unref)(void*) = nullptr;
  void* (*factory_find)(const char*) = nullptr;
  void* (*sample_get_buffer)(void*) = nullptr;
  void* (*sample_get_caps)(void*) = nullptr;
  void* (*caps_get_structure)(void*, unsigned) = nullptr;
  int (*structure_get_int)(void*, const char*, int*) = nullptr;
  const char* (*structure_get_string)(void*, const char*) = nullptr;
  int (*buffer_map)(void*, void*, int) = nullptr;
  void (*buffer_unmap)(void*, void*) = nullptr;
  int (*structure_get_fraction)(void*, const char*, int*, int*) = nullptr;
  void* (*bus_timed_pop_filtered)(void*, uint64_t, int) = nullptr;
  void* (*buffer_new_allocate)(void*, size_t, void*) = nullptr;
  size_t (*buffer_fill)(void*, size_t, const void*, size_t) = nullptr;
  int (*push_buffer)(void*, void*) = nullptr;
  int (*end_of_stream)(void*) = nullptr;
  void* (*try_pull_sample)(void*, uint64_t) = nullptr;
  int (*is_eos)(void*) = nullptr;
  void (*error_free)(void*) = nullptr;
  void (*g_free)(void*) = nullptr;

  bool Have(const std::string& element) const {
    void* factory = factory_find(element.c_str());
    if (factory) object_unref(factory);
    return factory != nullptr;
  }
  // the message of a GError*, and the GError freed
  std::string ErrorText(void* error) const {
    const char* message = *reinterpret_cast<const char* const*>(static_cast<const char*>(error) + kGErrorMessageOffset);
    std::string text = message ? message : "";
    error_free(error);
    text = text.substr(0, text.find('\n'));
    return text.find_first_not_of(" \t") == std::string::npos ? "unknown error" : text;
  }
};

const GstApi& Gst() {
  static GstApi api;
  static bool loaded = false;
  if (loaded) return api;
  const char* missing =
      "reading video needs GStreamer (libgstreamer-1.0.so.0 and libgstapp-1.0.so.0): on Debian or Ubuntu apt install "
      "gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-libav; JetPack ships it";
  void* gst = dlopen("libgstreamer-1.0.so.0", RTLD_NOW | RTLD_GLOBAL);
  void* app = gst ? dlopen("libgstapp-1.0.so.0", RTLD_NOW | RTLD_GLOBAL) : nullptr;
  void* glib = gst ? dlopen("libglib-2.0.so.0", RTLD_NOW | RTLD_GLOBAL) : nullptr;
  if (!gst || !app || !glib) refuse_usage(missing);
  auto need = [](void* lib, const char* name) {
    void* f = dlsym(lib, name);
    if (!f) refuse_usage(std::string("the GStreamer here has no ") + name + "; it needs GStreamer 1.10 or newer");
    return f;
  };
#define EDGEQ_GST(field, lib, name) api.field = reinterpret_cast<decltype(api.field)>(need(lib, name))
  EDGEQ_GST(init_check, gst, "gst_init_check");
  EDGEQ_GST(parse_launch, gst, "gst_parse_launch");
  EDGEQ_GST(bin_get_by_name, gst, "gst_bin_get_by_name");
  EDGEQ_GST(set_state, gst, "gst_element_set_state");
  EDGEQ_GST(get_bus, gst, "gst_element_get_bus");
  EDGEQ_GST(bus_pop_filtered, gst, "gst_bus_pop_filtered");
  EDGEQ_GST(message_parse_error, gst, "gst_message_parse_error");
  EDGEQ_GST(object_unref, gst, "gst_object_unref");
  EDGEQ_GST(mini_object_unref, gst, "gst_mini_object_unref");
  EDGEQ_GST(factory_find, gst, "gst_element_factory_find");
  EDGEQ_GST(sample_get_buffer, gst, "gst_sample_get_buffer");
  EDGEQ_GST(sample_get_caps, gst, "gst_sample_get_caps");
  EDGEQ_GST(caps_get_structure, gst, "gst_caps_get_structure");
  EDGEQ_GST(structure_get_int, gst, "gst_structure_get_int");
  EDGEQ_GST(structure_get_string, gst, "gst_structure_get_string");
  EDGEQ_GST(buffer_map, gst, "gst_buffer_map");
  EDGEQ_GST(buffer_unmap, gst, "gst_buffer_unmap");
  EDGEQ_GST(structure_get_fraction, gst, "gst_structure_get_fraction");
  EDGEQ_GST(bus_timed_pop_filtered, gst, "gst_bus_timed_pop_filtered");
  EDGEQ_GST(buffer_new_allocate, gst, "gst_buffer_new_allocate");
  EDGEQ_GST(buffer_fill, gst, "gst_buffer_fill");
  EDGEQ_GST(push_buffer, app, "gst_app_src_push_buffer");
  EDGEQ_GST(end_of_stream, app, "gst_app_src_end_of_stream");
  EDGEQ_GST(try_pull_sample, app, "gst_app_sink_try_pull_sample");
  EDGEQ_GST(is_eos, app, "gst_app_sink_is_eos");
  EDGEQ_GST(error_free, glib, "g_error_free");
  EDGEQ_GST(g_free, glib, "g_free");
#undef EDGEQ_GST
  if (!api.init_check(nullptr, nullptr, nullptr)) refuse_usage("GStreamer could not start (gst_init_check failed)");
  loaded = true;
  return api;
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

bool StartsWith(const std::string& s, const std::string& head) { return s.compare(0, head.size(), head) == 0; }

// video.is_stream
bool IsStream(const std::string& spec) {
  for (const char* p : {"gst:", "csi://", "rtsp://", "rtsps://"})
    if (StartsWith(spec, p)) return true;
  if (StartsWith(spec, "/dev/video") && spec.size() > 10 &&
      spec.find_first_not_of("0123456789", 10) == std::string::npos)
    return true;
  std::string lower = spec;
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  for (const char* s : {".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v", ".ts"})
    if (EndsWith(lower, s)) return true;
  return false;
}

// video.stream_input: whether an --input names a video source, and its name (empty: none) and source
bool StreamInput(const std::string& spec, std::string* name, std::string* source) {
  auto scheme = [](const std::string& s) {
    for (const char* p : {"gst:", "csi://", "rtsp://", "rtsps://", "/dev/video"})
      if (StartsWith(s, p)) return true;
    return false;
  };
  name->clear();
  if (scheme(spec)) return IsStream(*source = spec);
  size_t eq = spec.find('=');
  if (eq == std::string::npos) return IsStream(*source = spec);
  *name = spec.substr(0, eq);
  *source = spec.substr(eq + 1);
  return IsStream(*source);
}

// video.quote
std::string GstQuote(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string Strip(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\n\r\f\v"), b = s.find_last_not_of(" \t\n\r\f\v");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

bool IsWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

struct SourceDescription {
  std::string pipeline, name;
};

// video.describe: the pipeline description ending in edgeq's appsink, and a short name of the source
SourceDescription DescribeSource(const std::string& spec) {
  const GstApi& gst = Gst();
  std::string sink = std::string("appsink name=") + kSinkName + " sync=false max-buffers=2 drop=false caps=" + kRgbCaps;
  std::string convert = gst.Have("nvvidconv") ? "nvvidconv ! video/x-raw,format=BGRx ! videoconvert" : "videoconvert";
  if (StartsWith(spec, "gst:")) {
    std::string user = Strip(spec.substr(4));
    size_t bang = user.rfind('!');
    std::string last = Strip(bang == std::string::npos ? user : user.substr(bang + 1));
    bool appsink = StartsWith(last, "appsink") && (last.size() == 7 || std::isspace(static_cast<unsigned char>(last[7])));
    if (user.empty() || !appsink) refuse_usage("--input gst:PIPELINE must end in appsink (... ! videoconvert ! appsink)");
    for (size_t at = last.find("name="); at != std::string::npos; at = last.find("name=", at + 1))
      if (at == 0 || !IsWordChar(last[at - 1]))
        refuse_usage(std::string("--input gst:...: leave the appsink unnamed; edgeq names it ") + kSinkName);
    std::string head = user.substr(0, user.size() - last.size());
    // edgeq's name and RGB caps first: what the user set after them stands, and a format other than RGB is refused
    return {head + "appsink name=" + kSinkName + " caps=" + kRgbCaps + last.substr(7), "gst pipeline"};
  }
  if (StartsWith(spec, "csi://")) {
    std::string sensor = spec.substr(6);
    if (sensor.empty() || sensor.find_first_not_of("0123456789") != std::string::npos)
      refuse_usage("--input " + spec + ": a CSI camera is csi://N (N: the sensor, 0 for the first)");
    if (!gst.Have("nvarguscamerasrc"))
      refuse_usage("--input " + spec + " needs NVIDIA's nvarguscamerasrc (JetPack's GStreamer); it is not on this machine");
    return {"nvarguscamerasrc sensor-id=" + sensor + " ! video/x-raw(memory:NVMM) ! " + convert + " ! " + sink,
            "CSI camera " + sensor};
  }
  if (StartsWith(spec, "rtsp://") || StartsWith(spec, "rtsps://")) {
    std::string shown = spec;  // without user:password
    size_t host = shown.find("://") + 3, at = shown.find('@', host), slash = shown.find('/', host);
    if (at != std::string::npos && (slash == std::string::npos || at < slash)) shown.erase(host, at + 1 - host);
    return {"uridecodebin uri=" + GstQuote(spec) + " ! " + convert + " ! " + sink, shown};
  }
  struct stat st;
  if (StartsWith(spec, "/dev/video")) {
    if (stat(spec.c_str(), &st) != 0) refuse_usage("--input " + spec + ": there is no such camera (see ls /dev/video*)");
    return {"v4l2src device=" + GstQuote(spec) + " ! decodebin ! " + convert + " ! " + sink, "camera " + spec};
  }
  if (stat(spec.c_str(), &st) != 0) refuse_usage("--input " + spec + ": no such file");
  if (!S_ISREG(st.st_mode)) refuse_usage("--input " + spec + " is not a regular file");
  return {"filesrc location=" + GstQuote(spec) + " ! decodebin ! " + convert + " ! " + sink,
          spec.substr(spec.rfind('/') + 1)};
}

// video.explain
std::string ExplainGstError(const std::string& text) {
  std::string lower = text;
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (text.find("missing a plug-in") != std::string::npos || lower.find("no suitable plugins") != std::string::npos)
    return text + " (no decoder for this codec: install gstreamer1.0-libav or the plugins-good/-bad/-ugly sets)";
  if (lower.find("busy") != std::string::npos) return text + " (another program has the camera open)";
  return text;
}

// video._message_error: the error line of a bus message ("" for end of stream), the message released
std::string MessageError(const GstApi& gst, void* message) {
  int kind;
  std::memcpy(&kind, static_cast<const char*>(message) + kMessageTypeOffset, sizeof kind);
  std::string text;
  if (kind == kGstMessageError) {
    void* error = nullptr;
    char* debug = nullptr;
    gst.message_parse_error(message, &error, &debug);
    text = ExplainGstError(error ? gst.ErrorText(error) : "unknown error");
    if (debug) gst.g_free(debug);
  }
  gst.mini_object_unref(message);
  return text;
}

// video._release: a pipeline stopped (NULL state), it and its element and bus released, the handles cleared
void ReleasePipeline(const GstApi& gst, void** pipeline, void** element, void** bus) {
  if (*pipeline) gst.set_state(*pipeline, kGstStateNull);
  for (void** obj : {element, bus, pipeline})
    if (*obj) gst.object_unref(*obj), *obj = nullptr;
}

// video.Source: an open video source, frame by frame
class VideoSource {
 public:
  VideoSource(const std::string& spec, double timeout) : spec_(spec), timeout_(timeout), gst_(Gst()) {
    SourceDescription d = DescribeSource(spec);
    name_ = d.name;
    void* error = nullptr;
    pipeline_ = gst_.parse_launch(d.pipeline.c_str(), &error);
    if (error) {
      std::string text = gst_.ErrorText(error);
      Close();
      refuse_usage("--input " + spec + ": GStreamer cannot make the pipeline: " + text);
    }
    if (!pipeline_) refuse_usage("--input " + spec + ": GStreamer cannot make the pipeline");
    sink_ = gst_.bin_get_by_name(pipeline_, kSinkName);
    if (!sink_) {
      Close();
      refuse_usage("--input " + spec + ": the pipeline has no appsink");
    }
    bus_ = gst_.get_bus(pipeline_);
    // PAUSED first: a live source says so there (it cannot preroll), then PLAYING
    int paused = gst_.set_state(pipeline_, kGstStatePaused);
    int state = paused != kGstStateChangeFailure ? gst_.set_state(pipeline_, kGstStatePlaying) : paused;
    if (state == kGstStateChangeFailure) {
      std::string problem = BusError();
      Close();
      refuse_usage("--input " + spec + ": " + (problem.empty() ? "it would not start" : problem));
    }
    live_ = paused == kGstStateChangeNoPreroll;
  }
  ~VideoSource() { Close(); }
  VideoSource(const VideoSource&) = delete;
  VideoSource& operator=(const VideoSource&) = delete;

  std::atomic<bool> cancel{false};  // set by another thread: Read returns false at its next 0.1 s step

  bool live() const { return live_; }
  int rate_num() const { return rate_num_; }  // frames per second where the source says (0: it does not)
  int rate_den() const { return rate_den_; }
  const std::string& name() const { return name_; }

  // the next frame (RGB) and its timestamp (seconds, or < 0 where the buffer has none); false at the end
  bool Read(Pixels* out, double* seconds) {
    void* sample = nullptr;
    double waited = 0, step = 0.1;
    for (;;) {
      sample = gst_.try_pull_sample(sink_, uint64_t(step * 1e9));
      if (sample) break;
      std::string problem = BusError();
      if (!problem.empty()) {
        if (frames_ == 0) throw VideoFailed("cannot read " + name_ + ": " + problem);
        throw VideoFailed(name_ + " stopped after " + std::to_string(frames_) + " frames: " + problem);
      }
      if (gst_.is_eos(sink_) || cancel) return false;
      waited += step;
      if (waited >= timeout_) {
        char t[32];
        std::snprintf(t, sizeof t, "%g", timeout_);
        throw VideoFailed(name_ + " delivered no frame for " + t + " s (--timeout)");
      }
    }
    struct Unref {
      const GstApi& gst;
      void* sample;
      ~Unref() { gst.mini_object_unref(sample); }
    } unref{gst_, sample};
    void* structure = gst_.caps_get_structure(gst_.sample_get_caps(sample), 0);
    int w = 0, h = 0;
    if (!structure || !gst_.structure_get_int(structure, "width", &w) || !gst_.structure_get_int(structure, "height", &h))
      throw VideoFailed(name_ + ": a frame without its size");
    if (w <= 0 || h <= 0 || uint64_t(w) * uint64_t(h) > kMaxImagePixels)
      throw VideoFailed(name_ + ": a frame of " + std::to_string(w) + " x " + std::to_string(h) + " pixels");
    int num = 0, den = 0;
    if (rate_num_ == 0 && gst_.structure_get_fraction(structure, "framerate", &num, &den) && num > 0 && den > 0)
      rate_num_ = num, rate_den_ = den;
    const char* format = gst_.structure_get_string(structure, "format");
    if (!format || std::string(format) != "RGB")
      throw VideoFailed(name_ + " gives " + (format ? format : "unknown") + " frames; the appsink must take " + kRgbCaps);
    void* buffer = gst_.sample_get_buffer(sample);
    alignas(8) unsigned char info[kMapInfoBytes] = {};
    if (!gst_.buffer_map(buffer, info, kGstMapRead)) throw VideoFailed(name_ + ": a frame that cannot be read");
    const uint8_t* data = *reinterpret_cast<uint8_t* const*>(info + kMapDataOffset);
    size_t size = *reinterpret_cast<const size_t*>(info + kMapSizeOffset);
    size_t row = size_t(w) * 3, stride = (row + 3) & ~size_t(3);  // GStreamer's RGB rows start on 4 bytes
    if (size < stride * size_t(h - 1) + row) {
      gst_.buffer_unmap(buffer, info);
      throw VideoFailed(name_ + ": a frame of " + std::to_string(size) + " bytes for " + std::to_string(w) + " x " +
                        std::to_string(h) + " RGB");
    }
    out->h = h, out->w = w, out->c = 3;
    out->data.resize(row * size_t(h));
    for (int y = 0; y < h; ++y) std::memcpy(&out->data[size_t(y) * row], data + size_t(y) * stride, row);
    gst_.buffer_unmap(buffer, info);
    uint64_t pts;
    std::memcpy(&pts, static_cast<const char*>(buffer) + kBufferPtsOffset, sizeof pts);
    *seconds = pts == kGstClockTimeNone ? -1.0 : double(pts) / 1e9;
    ++frames_;
    return true;
  }

  void Close() { ReleasePipeline(gst_, &pipeline_, &sink_, &bus_); }

 private:
  std::string BusError() {
    void* message = bus_ ? gst_.bus_pop_filtered(bus_, kGstMessageError) : nullptr;
    return message ? MessageError(gst_, message) : "";
  }

  std::string spec_, name_;
  double timeout_;
  const GstApi& gst_;
  void *pipeline_ = nullptr, *sink_ = nullptr, *bus_ = nullptr;
  bool live_ = false;
  int64_t frames_ = 0;
  int rate_num_ = 0, rate_den_ = 0;
};

// imaging.draw_text: text at (x, y), clipped to the image
void DrawText(Pixels* p, int64_t x, int64_t y, const std::string& text, const unsigned char* colour) {
  for (size_t n = 0; n < text.size(); ++n) {
    int code = static_cast<unsigned char>(text[n]) - 32;
    if (code < 0 || code > 94) continue;
    for (int r = 0; r < kFontH; ++r)
      for (int k = 0; k < kFontW; ++k) {
        int64_t px = x + int64_t(n) * kFontW + k, py = y + r;
        if ((kFont[code * kFontH + r] >> (kFontW - 1 - k) & 1) && px >= 0 && px < p->w && py >= 0 && py < p->h)
          std::memcpy(&p->data[size_t((py * p->w + px) * 3)], colour, 3);
      }
  }
}

// imaging.box_pixels and draw_detections: boxes outlined in their class's colour, label bars, worst first
Pixels DrawDetections(Pixels p, const std::vector<Detection>& found) {
  if (p.c == 1) {
    std::vector<uint8_t> rgb(size_t(p.h * p.w * 3));
    for (size_t i = 0; i < size_t(p.h * p.w); ++i) rgb[i * 3] = rgb[i * 3 + 1] = rgb[i * 3 + 2] = p.data[i];
    p.data.swap(rgb);
    p.c = 3;
  }
  auto clampi = [](double v, int64_t hi) { return int64_t(std::max(0.0, std::min(double(hi), std::floor(v)))); };
  for (auto it = found.rbegin(); it != found.rend(); ++it) {
    const unsigned char* colour = kBoxColours[((it->cls % kBoxColourCount) + kBoxColourCount) % kBoxColourCount];
    int64_t x1 = clampi(it->box[0], p.w - 1), y1 = clampi(it->box[1], p.h - 1);
    int64_t x2 = std::max(x1, clampi(it->box[2], p.w - 1)), y2 = std::max(y1, clampi(it->box[3], p.h - 1));
    auto fill = [&](int64_t ya, int64_t yb, int64_t xa, int64_t xb) {  // [ya, yb) x [xa, xb), clipped
      for (int64_t y = std::max<int64_t>(ya, 0); y < std::min(yb, p.h); ++y)
        for (int64_t x = std::max<int64_t>(xa, 0); x < std::min(xb, p.w); ++x)
          std::memcpy(&p.data[size_t((y * p.w + x) * 3)], colour, 3);
    };
    fill(y1, std::min(y1 + kBoxLine, y2 + 1), x1, x2 + 1);
    fill(std::max(y2 - kBoxLine + 1, y1), y2 + 1, x1, x2 + 1);
    fill(y1, y2 + 1, x1, std::min(x1 + kBoxLine, x2 + 1));
    fill(y1, y2 + 1, std::max(x2 - kBoxLine + 1, x1), x2 + 1);
    int64_t bar_h = kFontH + 2, bar_w = int64_t(it->label.size()) * kFontW + 2;
    int64_t top = y1 >= bar_h ? y1 - bar_h : y1;
    fill(top, top + bar_h, x1, x1 + bar_w);
    DrawText(&p, x1 + 1, top + 1, it->label, kTextColour);
  }
  return p;
}

// video.encoder: the elements that encode RGB frames for path (its suffix picks the container); "" where the
// suffix is not a video's
std::string VideoSuffix(const std::string& path) {
  size_t dot = path.rfind('.'), slash = path.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  std::string suffix = path.substr(dot);
  for (char& c : suffix) c = char(std::tolower(static_cast<unsigned char>(c)));
  return suffix;
}

const char* VideoMuxer(const std::string& suffix) {  // video.VIDEO_MUXERS
  if (suffix == ".mp4" || suffix == ".m4v") return "mp4mux";
  if (suffix == ".mov") return "qtmux";
  if (suffix == ".mkv") return "matroskamux";
  if (suffix == ".avi") return "avimux";
  return nullptr;
}

std::string VideoEncoder(const std::string& path) {
  const GstApi& gst = Gst();
  std::string suffix = VideoSuffix(path);
  const char* mux = VideoMuxer(suffix);
  if (!mux) refuse_usage("--output " + path + ": a video is written as .avi, .m4v, .mkv, .mov, .mp4, or frames as PNG into a folder (DIR/)");
  std::string chain;
  if (suffix == ".avi") chain = "videoconvert ! jpegenc";
  else if (gst.Have("nvv4l2h264enc")) chain = "nvvidconv ! video/x-raw(memory:NVMM),format=NV12 ! nvv4l2h264enc ! h264parse";
  else if (gst.Have("x264enc")) chain = "videoconvert ! x264enc speed-preset=veryfast";
  else if (gst.Have("avenc_mpeg4")) chain = "videoconvert ! avenc_mpeg4 bitrate=4000000";
  else
    refuse_usage("--output " + path + " needs an H.264 or MPEG-4 encoder in GStreamer (x264enc: gstreamer1.0-plugins-ugly; "
                 "avenc_mpeg4: gstreamer1.0-libav), or give .avi (MJPEG)");
  std::vector<std::string> needed = {mux};
  if (suffix == ".avi") needed.push_back("jpegenc");
  for (const std::string& element : needed)
    if (!gst.Have(element))
      refuse_usage("--output " + path + " needs GStreamer's " + element + " (gstreamer1.0-plugins-good)");
  return chain + " ! " + mux;
}

// video.Writer: a video file written frame by frame, into a temporary file renamed over path at the end
class VideoWriter {
 public:
  explicit VideoWriter(const std::string& path) : path_(path), chain_(VideoEncoder(path)), gst_(Gst()) {
    tmp_ = path + ".tmp" + std::to_string(getpid()) + VideoSuffix(path);
  }
  ~VideoWriter() { Discard(); }
  VideoWriter(const VideoWriter&) = delete;
  VideoWriter& operator=(const VideoWriter&) = delete;

  // one frame at seconds (the source's timestamp; < 0: one frame period after the last)
  void Write(const Pixels& p, double seconds, int rate_num, int rate_den) {
    if (!pipeline_) Open(p.w, p.h, rate_num, rate_den);
    else if (p.w != width_ || p.h != height_)
      throw VideoFailed("cannot write " + path_ + ": the frames changed size (" + std::to_string(width_) + " x " +
                        std::to_string(height_) + " to " + std::to_string(p.w) + " x " + std::to_string(p.h) + ")");
    size_t row = size_t(p.w) * 3, stride = (row + 3) & ~size_t(3);
    std::vector<uint8_t> data(stride * size_t(p.h), 0);
    for (int64_t y = 0; y < p.h; ++y) std::memcpy(&data[size_t(y) * stride], &p.data[size_t(y) * row], row);
    void* buffer = gst_.buffer_new_allocate(nullptr, data.size(), nullptr);
    gst_.buffer_fill(buffer, 0, data.data(), data.size());
    double at;
    if (seconds < 0 || (!started_ && frames_ > 0)) {
      at = double(frames_) * period_;
    } else {
      if (!started_) start_ = seconds, started_ = true;
      at = std::max(seconds - start_, 0.0);
    }
    uint64_t pts = uint64_t(std::llround(at * 1e9)), duration = uint64_t(std::llround(period_ * 1e9));
    std::memcpy(static_cast<char*>(buffer) + kBufferPtsOffset, &pts, sizeof pts);
    std::memcpy(static_cast<char*>(buffer) + kBufferPtsOffset + 16, &duration, sizeof duration);
    if (gst_.push_buffer(src_, buffer) != 0) {
      std::string problem = Error();
      throw VideoFailed("cannot write " + path_ + ": " + (problem.empty() ? "the encoder stopped" : problem));
    }
    ++frames_;
  }

  // the end of the stream: wait for the muxer, then rename the file into place
  void Close() {
    if (!pipeline_) return;
    gst_.end_of_stream(src_);
    void* message = gst_.bus_timed_pop_filtered(bus_, uint64_t(60e9), kGstMessageEos | kGstMessageError);
    std::string problem = message ? MessageError(gst_, message) : "the encoder did not finish in 60 s";
    Stop();
    if (!problem.empty()) {
      Discard();
      throw VideoFailed("cannot write " + path_ + ": " + problem);
    }
    if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
      std::string why = std::strerror(errno);
      Discard();
      throw VideoFailed("cannot write " + path_ + ": " + why);
    }
  }

  void Discard() {
    Stop();
    struct stat st;
    if (lstat(tmp_.c_str(), &st) == 0 && !S_ISLNK(st.st_mode)) std::remove(tmp_.c_str());
  }

 private:
  void Open(int64_t w, int64_t h, int num, int den) {
    if (num <= 0 || den <= 0) num = 30, den = 1;
    std::string description = std::string("appsrc name=edgeq_src format=time block=true caps=video/x-raw,format=RGB,width=") +
                              std::to_string(w) + ",height=" + std::to_string(h) + ",framerate=" + std::to_string(num) +
                              "/" + std::to_string(den) + " ! " + chain_ + " ! filesink location=" + GstQuote(tmp_);
    void* error = nullptr;
    pipeline_ = gst_.parse_launch(description.c_str(), &error);
    if (error || !pipeline_) {
      std::string text = error ? gst_.ErrorText(error) : "unknown error";
      Stop();
      throw VideoFailed("cannot write " + path_ + ": " + text);
    }
    src_ = gst_.bin_get_by_name(pipeline_, "edgeq_src");
    bus_ = gst_.get_bus(pipeline_);
    width_ = w, height_ = h, period_ = double(den) / double(num);
    if (gst_.set_state(pipeline_, kGstStatePlaying) == kGstStateChangeFailure) {
      std::string problem = Error();
      throw VideoFailed("cannot write " + path_ + ": " + (problem.empty() ? "the encoder would not start" : problem));
    }
  }
  std::string Error() {
    void* message = bus_ ? gst_.bus_pop_filtered(bus_, kGstMessageError) : nullptr;
    return message ? MessageError(gst_, message) : "";
  }
  void Stop() { ReleasePipeline(gst_, &pipeline_, &src_, &bus_); }

  std::string path_, chain_, tmp_;
  const GstApi& gst_;
  void *pipeline_ = nullptr, *src_ = nullptr, *bus_ = nullptr;
  int64_t width_ = 0, height_ = 0, frames_ = 0;
  double period_ = 1.0 / 30, start_ = 0;
  bool started_ = false;
};

// an 8-bit RGB PNG of p, through the system's libpng (its simplified write API, libpng >= 1.6.29)
std::string PngBytes(const Pixels& p) {
  void* lib = OpenLibrary({"libpng16.so.16", "libpng16.so"},
                          "writing PNG frames needs libpng 1.6 (libpng16.so.16): apt install libpng16-16");
  using Write = int (*)(PngImage*, void*, size_t*, int, const void*, int32_t, const void*);
  auto write = reinterpret_cast<Write>(dlsym(lib, "png_image_write_to_memory"));
  if (!write) refuse_usage("this libpng16 cannot write to memory (libpng >= 1.6.29 is needed)");
  PngImage image{};
  image.version = 1, image.width = uint32_t(p.w), image.height = uint32_t(p.h), image.format = kPngColor;
  size_t bytes = 0;
  if (!write(&image, nullptr, &bytes, 0, p.data.data(), 0, nullptr) || bytes == 0)
    refuse_usage("cannot make a PNG: " + std::string(image.message, strnlen(image.message, 64)));
  std::string out(bytes, '\0');
  PngImage again{};
  again.version = 1, again.width = uint32_t(p.w), again.height = uint32_t(p.h), again.format = kPngColor;
  if (!write(&again, &out[0], &bytes, 0, p.data.data(), 0, nullptr))
    refuse_usage("cannot make a PNG: " + std::string(again.message, strnlen(again.message, 64)));
  out.resize(bytes);
  return out;
}

}  // namespace
