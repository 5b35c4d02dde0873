// image.h: edgeq-run --input IMAGE and --postprocess, as templates/imaging.py defines them
// (decode_image, image_tensor, classify), operation by operation: PNG through the system's libpng 1.6
// (simplified API), JPEG through the system's libturbojpeg, both dlopen'ed as libcrypto is; no decoder is
// linked or copied in. edgeq-run is built with -ffp-contract=off, so the float32 arithmetic below rounds as
// numpy's does and the tensor is bit-identical to run.py's and to the one the packager calibrated with.
#pragma once

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "contract.h"
#include "files.h"
#include "json.h"
#include "npy.h"
#include "refuse.h"
#include "zip.h"

namespace {

struct Pixels {
  int64_t h = 0, w = 0, c = 0;
  std::vector<uint8_t> data;  // [h, w, c]
};

struct Preprocess {  // contract.PreprocessRecord
  bool given = false;
  std::string input, resize, order, layout;
  int64_t height = 0, width = 0;
  double scale = 1;
  std::vector<double> mean, std;
};

struct Postprocess {  // contract.PostprocessRecord
  bool given = false;
  std::string kind, output;
  int64_t top_k = 0;
  bool softmax = false;
  std::vector<std::string> labels;
  std::string selected;  // yolo
  int64_t classes = -1, max_det = -1;
  double conf = 0, iou = 0;
};

void* OpenLibrary(const std::vector<const char*>& names, const std::string& what) {
  for (const char* name : names)
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return lib;
  refuse_usage(what);
}

// libpng 1.6's png_image (png.h, PNG_IMAGE_VERSION 1): a public, fixed structure
struct PngImage {
  void* opaque;
  uint32_t version, width, height, format, flags, colormap_entries, warning_or_error;
  char message[64];
};
constexpr uint32_t kPngAlpha = 0x01, kPngColor = 0x02, kPngLinear = 0x04;

void CheckPixels(int64_t w, int64_t h, const std::string& path) {
  if (w <= 0 || h <= 0 || uint64_t(w) * uint64_t(h) > kMaxImagePixels)
    refuse_usage(path + " has " + std::to_string(w) + " x " + std::to_string(h) + " pixels, more than " +
                 std::to_string(kMaxImagePixels));
}

// imaging.png_pixel_chunks: every chunk's length and CRC checked; only IHDR, PLTE, IDAT and IEND kept
std::string PngPixelChunks(const std::string& data, const std::string& path) {
  const auto* d = reinterpret_cast<const unsigned char*>(data.data());
  auto be32 = [&](size_t at) { return uint32_t(d[at]) << 24 | uint32_t(d[at + 1]) << 16 | uint32_t(d[at + 2]) << 8 | d[at + 3]; };
  std::string out = data.substr(0, 8);
  size_t pos = 8;
  bool first = true;
  for (;;) {
    if (pos + 12 > data.size()) refuse_usage("cannot decode " + path + ": the PNG ends before its IEND chunk");
    uint64_t length = be32(pos);
    std::string kind = data.substr(pos + 4, 4);
    bool alpha = std::all_of(kind.begin(), kind.end(), [](char c) { return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'); });
    if (length > 0x7FFFFFFF || pos + 12 + length > data.size() || !alpha)
      refuse_usage("cannot decode " + path + ": PNG chunk at byte " + std::to_string(pos) + " is damaged");
    if (Crc32(d + pos + 4, size_t(length) + 4) != be32(pos + 8 + size_t(length)))
      refuse_usage("cannot decode " + path + ": PNG chunk " + kind + " has a bad CRC");
    if (first != (kind == "IHDR")) refuse_usage("cannot decode " + path + ": a PNG starts with its IHDR chunk, once");
    first = false;
    if (kind == "IHDR" || kind == "PLTE" || kind == "IDAT" || kind == "IEND") out.append(data, pos, size_t(length) + 12);
    pos += size_t(length) + 12;
    if (kind == "IEND") return out;
  }
}

Pixels DecodePng(const std::string& file, const std::string& path) {
  const std::string bytes = PngPixelChunks(file, path);
  void* lib = OpenLibrary({"libpng16.so.16", "libpng16.so"},
                          "reading PNG images needs libpng 1.6 (libpng16.so.16): apt install libpng16-16");
  using Begin = int (*)(PngImage*, const void*, size_t);
  using Finish = int (*)(PngImage*, const void*, void*, int32_t, void*);
  using Free = void (*)(PngImage*);
  auto begin = reinterpret_cast<Begin>(dlsym(lib, "png_image_begin_read_from_memory"));
  auto finish = reinterpret_cast<Finish>(dlsym(lib, "png_image_finish_read"));
  auto release = reinterpret_cast<Free>(dlsym(lib, "png_image_free"));
  if (!begin || !finish || !release) refuse_usage("this libpng16 lacks the simplified API (libpng >= 1.6 is needed)");
  PngImage image{};
  image.version = 1;
  if (!begin(&image, bytes.data(), bytes.size()))
    refuse_usage("cannot decode " + path + ": " + std::string(image.message, strnlen(image.message, 64)));
  if (image.format & kPngLinear) {
    release(&image);
    refuse_usage(path + " is a 16-bit PNG; give an 8-bit one");
  }
  if (uint64_t(image.width) * uint64_t(image.height) > kMaxImagePixels || !image.width || !image.height) {
    release(&image);
    CheckPixels(image.width, image.height, path);
  }
  bool color = image.format & kPngColor;
  image.format = (color ? kPngColor : 0) | kPngAlpha;  // alpha kept, so nothing is composited; dropped below
  size_t in_c = color ? 4 : 2;
  std::vector<uint8_t> buffer(size_t(image.width) * image.height * in_c);
  if (!finish(&image, nullptr, buffer.data(), 0, nullptr))
    refuse_usage("cannot decode " + path + ": " + std::string(image.message, strnlen(image.message, 64)));
  Pixels p;
  p.h = image.height, p.w = image.width, p.c = color ? 3 : 1;
  p.data.resize(size_t(p.h * p.w * p.c));
  for (size_t i = 0, n = size_t(p.h * p.w); i < n; ++i)
    for (size_t k = 0; k < size_t(p.c); ++k) p.data[i * p.c + k] = buffer[i * in_c + k];
  return p;
}

Pixels DecodeJpeg(const std::string& bytes, const std::string& path) {
  void* lib = OpenLibrary({"libturbojpeg.so.0", "libturbojpeg.so"},
                          "reading JPEG images needs libjpeg-turbo's TurboJPEG library (libturbojpeg.so.0): apt install "
                          "libturbojpeg0 (Debian) or libturbojpeg (Ubuntu, JetPack)");
  using Init = void* (*)();
  using Header = int (*)(void*, const unsigned char*, unsigned long, int*, int*, int*, int*);
  using Decompress = int (*)(void*, const unsigned char*, unsigned long, unsigned char*, int, int, int, int, int);
  using Error = char* (*)(void*);
  using Destroy = int (*)(void*);
  auto init = reinterpret_cast<Init>(dlsym(lib, "tjInitDecompress"));
  auto header = reinterpret_cast<Header>(dlsym(lib, "tjDecompressHeader3"));
  auto decompress = reinterpret_cast<Decompress>(dlsym(lib, "tjDecompress2"));
  auto error = reinterpret_cast<Error>(dlsym(lib, "tjGetErrorStr2"));
  auto destroy = reinterpret_cast<Destroy>(dlsym(lib, "tjDestroy"));
  if (!init || !header || !decompress || !error || !destroy) refuse_usage("this libturbojpeg is too old (>= 1.5 is needed)");
  void* tj = init();
  if (!tj) refuse_usage("libturbojpeg could not start");
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  int w = 0, h = 0, subsampling = 0, colorspace = 0;
  if (header(tj, data, bytes.size(), &w, &h, &subsampling, &colorspace) != 0) {
    std::string why = error(tj);
    destroy(tj);
    refuse_usage("cannot decode " + path + ": " + why);
  }
  if (colorspace == 3 || colorspace == 4) {  // TJCS_CMYK, TJCS_YCCK
    destroy(tj);
    refuse_usage(path + " is a CMYK JPEG; give an 8-bit gray, RGB or RGBA PNG or JPEG");
  }
  if (uint64_t(w) * uint64_t(h) > kMaxImagePixels || w <= 0 || h <= 0) {
    destroy(tj);
    CheckPixels(w, h, path);
  }
  Pixels p;
  p.h = h, p.w = w, p.c = colorspace == 2 ? 1 : 3;  // TJCS_GRAY: gray, as Pillow opens it
  p.data.resize(size_t(p.h * p.w * p.c));
  // TJPF_GRAY 6, TJPF_RGB 0; flags 0: the accurate IDCT and fancy upsampling, libjpeg's defaults (Pillow's)
  if (decompress(tj, data, bytes.size(), p.data.data(), w, 0, h, p.c == 1 ? 6 : 0, 0) != 0) {
    std::string why = error(tj);
    destroy(tj);
    refuse_usage("cannot decode " + path + ": " + why);
  }
  destroy(tj);
  return p;
}

Pixels DecodeImage(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) refuse_usage("cannot read --input " + path);
  if (uint64_t(st.st_size) > kMaxImageFileBytes)
    refuse_usage(path + " is larger than " + std::to_string(kMaxImageFileBytes) + " bytes");
  std::string bytes = ReadFile(path, kMaxImageFileBytes, "--input " + path);
  if (bytes.size() >= 8 && bytes.compare(0, 8, "\x89PNG\r\n\x1a\n", 8) == 0) {
    if (bytes.size() > 24 && uint8_t(bytes[24]) == 16) refuse_usage(path + " is a 16-bit PNG; give an 8-bit one");
    return DecodePng(bytes, path);
  }
  if (bytes.size() >= 3 && bytes.compare(0, 3, "\xff\xd8\xff", 3) == 0) return DecodeJpeg(bytes, path);
  refuse_usage(path + " is not a PNG or JPEG image");
}

bool LooksLikeImage(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  unsigned char head[8] = {0};
  size_t n = std::fread(head, 1, 8, f);
  std::fclose(f);
  return (n == 8 && std::memcmp(head, "\x89PNG\r\n\x1a\n", 8) == 0) || (n >= 3 && std::memcmp(head, "\xff\xd8\xff", 3) == 0);
}

// imaging._bilinear: half-pixel centres, positions in double, weights and arithmetic in float32
void Taps(int64_t in, int64_t out, std::vector<int64_t>& low, std::vector<int64_t>& high, std::vector<float>& weight) {
  low.resize(size_t(out)), high.resize(size_t(out)), weight.resize(size_t(out));
  for (int64_t o = 0; o < out; ++o) {
    double pos = (double(o) + 0.5) * (double(in) / double(out)) - 0.5;
    pos = std::min(std::max(pos, 0.0), double(in - 1));
    double floor = std::floor(pos);
    weight[size_t(o)] = float(pos - floor);
    low[size_t(o)] = int64_t(floor);
    high[size_t(o)] = std::min(low[size_t(o)] + 1, in - 1);
  }
}

std::vector<float> Bilinear(const Pixels& p, int64_t height, int64_t width) {
  std::vector<int64_t> y0, y1, x0, x1;
  std::vector<float> wy, wx;
  Taps(p.h, height, y0, y1, wy);
  Taps(p.w, width, x0, x1, wx);
  std::vector<float> out(size_t(height * width * p.c));
  auto at = [&](int64_t y, int64_t x, int64_t k) { return float(p.data[size_t((y * p.w + x) * p.c + k)]); };
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x)
      for (int64_t k = 0; k < p.c; ++k) {
        float ax = 1.0f - wx[size_t(x)], ay = 1.0f - wy[size_t(y)];
        float a = at(y0[size_t(y)], x0[size_t(x)], k) * ax;
        float b = at(y0[size_t(y)], x1[size_t(x)], k) * wx[size_t(x)];
        float top = a + b;
        float c = at(y1[size_t(y)], x0[size_t(x)], k) * ax;
        float d = at(y1[size_t(y)], x1[size_t(x)], k) * wx[size_t(x)];
        float bottom = c + d;
        float e = top * ay;
        float f = bottom * wy[size_t(y)];
        out[size_t((y * width + x) * p.c + k)] = e + f;
      }
  return out;
}

// imaging.letterbox_geometry: the image scaled to fit, at least one row and column, centred by what it takes
struct Letterbox {
  double scale;
  int64_t new_h, new_w, top, left;
};
Letterbox LetterboxGeometry(const Preprocess& pre, int64_t image_h, int64_t image_w) {
  Letterbox g;
  g.scale = std::min(double(pre.height) / double(image_h), double(pre.width) / double(image_w));
  g.new_h = std::max<int64_t>(1, int64_t(std::nearbyint(double(image_h) * g.scale)));
  g.new_w = std::max<int64_t>(1, int64_t(std::nearbyint(double(image_w) * g.scale)));
  g.top = int64_t(std::nearbyint(double(pre.height - g.new_h) / 2 - 0.1));
  g.left = int64_t(std::nearbyint(double(pre.width - g.new_w) / 2 - 0.1));
  return g;
}

// imaging.image_tensor
HostTensor ImageTensor(Pixels p, const Preprocess& pre) {
  if (pre.order == "GRAY" && p.c == 3) {  // ITU-R 601 luma in Pillow's integer arithmetic
    std::vector<uint8_t> gray(size_t(p.h * p.w));
    for (size_t i = 0; i < gray.size(); ++i) {
      uint32_t r = p.data[i * 3], g = p.data[i * 3 + 1], b = p.data[i * 3 + 2];
      gray[i] = uint8_t((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16);
    }
    p.data.swap(gray);
    p.c = 1;
  } else if (pre.order != "GRAY" && p.c == 1) {
    std::vector<uint8_t> rgb(size_t(p.h * p.w * 3));
    for (size_t i = 0; i < size_t(p.h * p.w); ++i) rgb[i * 3] = rgb[i * 3 + 1] = rgb[i * 3 + 2] = p.data[i];
    p.data.swap(rgb);
    p.c = 3;
  }
  if (pre.order == "BGR")
    for (size_t i = 0; i < size_t(p.h * p.w); ++i) std::swap(p.data[i * 3], p.data[i * 3 + 2]);
  std::vector<float> hwc;
  if (pre.resize == "letterbox") {
    Letterbox g = LetterboxGeometry(pre, p.h, p.w);
    int64_t new_h = g.new_h, new_w = g.new_w, top = g.top, left = g.left;
    std::vector<float> inner = Bilinear(p, new_h, new_w);
    hwc.assign(size_t(pre.height * pre.width * p.c), float(kPadValue));
    for (int64_t y = 0; y < new_h && top + y < pre.height; ++y)
      for (int64_t x = 0; x < new_w && left + x < pre.width; ++x)
        for (int64_t k = 0; k < p.c; ++k)
          hwc[size_t(((top + y) * pre.width + left + x) * p.c + k)] = inner[size_t((y * new_w + x) * p.c + k)];
  } else {
    hwc = Bilinear(p, pre.height, pre.width);
  }
  float scale = float(pre.scale);
  for (size_t i = 0; i < hwc.size(); ++i) {
    size_t k = i % size_t(p.c);
    float mean = float(pre.mean.size() == 1 ? pre.mean[0] : pre.mean[k]);
    float std = float(pre.std.size() == 1 ? pre.std[0] : pre.std[k]);
    float v = hwc[i] / scale;
    v = v - mean;
    hwc[i] = v / std;
  }
  HostTensor t;
  t.name = pre.input;
  t.dtype = ParseDType("float32");
  std::vector<float> out(hwc.size());
  if (pre.layout == "NCHW") {
    t.shape = {1, p.c, pre.height, pre.width};
    for (int64_t y = 0; y < pre.height; ++y)
      for (int64_t x = 0; x < pre.width; ++x)
        for (int64_t k = 0; k < p.c; ++k)
          out[size_t((k * pre.height + y) * pre.width + x)] = hwc[size_t((y * pre.width + x) * p.c + k)];
  } else {
    t.shape = {1, pre.height, pre.width, p.c};
    out = hwc;
  }
  t.data.resize(out.size() * sizeof(float));
  std::memcpy(t.data.data(), out.data(), t.data.size());
  return t;
}

double Number(const Json& j, const std::string& where) {
  if (j.kind != Json::kNumber || !std::isfinite(j.num)) refuse("manifest field '" + where + "' is not a number");
  return j.num;
}

// contract.PreprocessRecord and PostprocessRecord, checked as contract.process_problem checks them
Preprocess ParsePreprocess(const Json& m) {
  Preprocess pre;
  const Json* j = m.Find("preprocess");
  if (!j || j->kind == Json::kNull) return pre;
  if (j->kind != Json::kObject) refuse("manifest field 'preprocess' is not an object");
  pre.given = true;
  pre.input = j->At("input", "preprocess.").Str("preprocess.input");
  pre.height = j->At("height", "preprocess.").Int("preprocess.height");
  pre.width = j->At("width", "preprocess.").Int("preprocess.width");
  pre.resize = j->At("resize", "preprocess.").Str("preprocess.resize");
  pre.order = j->At("order", "preprocess.").Str("preprocess.order");
  pre.layout = j->At("layout", "preprocess.").Str("preprocess.layout");
  pre.scale = Number(j->At("scale", "preprocess."), "preprocess.scale");
  for (const char* key : {"mean", "std"}) {
    std::string where = std::string("preprocess.") + key;
    for (const Json& v : j->At(key, "preprocess.").Arr(where)) (key[0] == 'm' ? pre.mean : pre.std).push_back(Number(v, where));
  }
  if (pre.height < 0 || pre.width < 0) refuse("manifest field 'preprocess.height' is not a count");
  return pre;
}

Postprocess ParsePostprocess(const Json& m) {
  Postprocess post;
  const Json* j = m.Find("postprocess");
  if (!j || j->kind == Json::kNull) return post;
  if (j->kind != Json::kObject) refuse("manifest field 'postprocess' is not an object");
  post.given = true;
  post.kind = j->At("kind", "postprocess.").Str("postprocess.kind");
  post.output = j->At("output", "postprocess.").Str("postprocess.output");
  post.top_k = j->At("top_k", "postprocess.").Int("postprocess.top_k");
  const Json& softmax = j->At("softmax", "postprocess.");
  if (softmax.kind != Json::kBool) refuse("manifest field 'postprocess.softmax' is not true or false");
  post.softmax = softmax.b;
  for (const Json& v : j->At("labels", "postprocess.").Arr("postprocess.labels")) post.labels.push_back(v.Str("postprocess.labels"));
  auto optional = [&](const char* key) -> const Json* {
    const Json* v = j->Find(key);
    return v && v->kind != Json::kNull ? v : nullptr;
  };
  bool negative = post.top_k < 0;
  if (const Json* v = optional("selected")) post.selected = v->Str("postprocess.selected");
  if (const Json* v = optional("classes")) {
    post.classes = v->Int("postprocess.classes");
    negative = negative || post.classes < 0;
  }
  if (const Json* v = optional("max_det")) {
    post.max_det = v->Int("postprocess.max_det");
    negative = negative || post.max_det < 0;
  }
  if (const Json* v = optional("conf")) post.conf = Number(*v, "postprocess.conf");
  if (const Json* v = optional("iou")) post.iou = Number(*v, "postprocess.iou");
  if (negative) refuse("manifest field 'postprocess' has a negative count");
  return post;
}

template <typename Spec>
std::string ProcessProblem(const Preprocess& pre, const Postprocess& post, const std::vector<Spec>& inputs,
                           const std::vector<Spec>& outputs) {
  if (pre.given) {
    const Spec* spec = nullptr;
    for (const Spec& s : inputs)
      if (s.name == pre.input) { spec = &s; break; }
    int64_t channels = pre.order == "GRAY" ? 1 : 3;
    std::vector<int64_t> want = pre.layout == "NCHW" ? std::vector<int64_t>{1, channels, pre.height, pre.width}
                                                     : std::vector<int64_t>{1, pre.height, pre.width, channels};
    if (!spec || spec->shape != want || spec->dtype.name != "float32")
      return "manifest field 'preprocess' does not fit input '" + pre.input + "'";
    bool zero_std = std::find(pre.std.begin(), pre.std.end(), 0.0) != pre.std.end();
    if ((pre.resize != "stretch" && pre.resize != "letterbox") ||
        (pre.order != "RGB" && pre.order != "BGR" && pre.order != "GRAY") ||
        (pre.layout != "NCHW" && pre.layout != "NHWC") || pre.scale == 0 ||
        (pre.mean.size() != 1 && int64_t(pre.mean.size()) != channels) ||
        (pre.std.size() != 1 && int64_t(pre.std.size()) != channels) || zero_std || pre.height < 1 ||
        pre.height > kMaxImageSide || pre.width < 1 || pre.width > kMaxImageSide)
      return "manifest field 'preprocess' has a value out of range";
  }
  if (post.given) {
    const Spec* spec = nullptr;
    for (const Spec& s : outputs)
      if (s.name == post.output) { spec = &s; break; }
    std::string bad = "manifest field 'postprocess' does not fit output '" + post.output + "'";
    if ((post.kind != "classify" && post.kind != "yolo") || !spec || spec->shape.empty() || spec->shape[0] != 1 ||
        post.top_k < 1 || post.top_k > 1000 || post.labels.size() > size_t(kMaxLabels))
      return bad;
    if (post.kind == "yolo") {
      const Spec* rows = nullptr;
      for (const Spec& s : outputs)
        if (s.name == post.selected && !post.selected.empty()) { rows = &s; break; }
      if (!rows || rows->rows_axis < 0 || rows->dtype.name != "int64" || rows->shape.size() != 2 || rows->shape[1] != 3 ||
          spec->shape.size() != 3 || post.classes < 1 || post.classes > spec->shape[1] - 4 || post.max_det < 1 ||
          post.max_det > 100000 || int64_t(post.labels.size()) > post.classes)
        return bad;
    }
  }
  return "";
}

// imaging.yolo, printed as run.py prints it. ``real``: the selected rows that are real; ``image_h/w``: the image
// the input was made from (0: none, boxes stay in input pixels)
struct Detection {  // one of YoloJson's rows, for drawing (video.h)
  int64_t cls;
  double box[4];  // as printed: rounded to 0.01 px
  std::string label;  // imaging.label_text: "LABEL 0.91", printable ASCII
};

// imaging.label_text: the label (or class N) and the score to 2 decimals; a character outside printable ASCII is
// '?' (one per UTF-8 code point, as Python counts them)
std::string LabelText(const std::string& name, double score) {
  char s[32];
  std::snprintf(s, sizeof s, " %.2f", score);
  std::string out;
  for (char c : name + s) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u <= 0x7e) out += c;
    else if ((u & 0xC0) != 0x80) out += '?';
  }
  return out;
}

std::string YoloJson(const HostTensor& head, const HostTensor& rows, int64_t real, const Postprocess& post,
                     const Preprocess& pre, int64_t image_h, int64_t image_w, std::string* text,
                     std::vector<Detection>* drawn = nullptr) {
  int64_t channels = head.shape[head.shape.size() - 2], anchors = head.shape.back();
  auto at = [&](int64_t k, int64_t b) -> double {
    if (k < 0 || k >= channels || b < 0 || b >= anchors) return 0.0;
    return ElementAsDouble(head.dtype, &head.data[size_t(k * anchors + b) * size_t(head.dtype.bytes)]);
  };
  auto row = [&](int64_t r, int64_t k) {
    int64_t v;
    std::memcpy(&v, &rows.data[size_t(r * 3 + k) * sizeof(int64_t)], sizeof v);
    return v;
  };
  struct Found { double score; int64_t r, c, b; };
  std::vector<Found> found;
  for (int64_t r = 0; r < real; ++r) {
    int64_t c = row(r, 1), b = row(r, 2);
    if (c < 0 || c >= channels - 4 || b < 0 || b >= anchors)  // imaging.yolo_row_problem
      refuse("the model's selected row " + std::to_string(r) + " names class " + std::to_string(c) + " and box " +
             std::to_string(b) + "; its head has " + std::to_string(channels - 4) + " classes and " +
             std::to_string(anchors) + " boxes: the bundle is damaged");
    found.push_back({at(4 + c, b), r, c, b});
  }
  std::stable_sort(found.begin(), found.end(), [](const Found& x, const Found& y) { return x.score > y.score; });
  double sx = 1, sy = 1, left = 0, top = 0;  // imaging._unletterbox
  bool image = image_h > 0 && image_w > 0 && pre.given;
  if (image && pre.resize == "letterbox") {
    Letterbox g = LetterboxGeometry(pre, image_h, image_w);
    top = double(g.top), left = double(g.left);
    sx = sy = g.scale;
  } else if (image) {
    sx = double(pre.width) / double(image_w), sy = double(pre.height) / double(image_h);
  }
  std::string json;
  size_t n = std::min(found.size(), size_t(post.max_det));
  if (n == 0) *text = "no detections";
  for (size_t i = 0; i < n; ++i) {
    const Found& f = found[i];
    double cx = at(0, f.b), cy = at(1, f.b), w = at(2, f.b), h = at(3, f.b);
    double box[4] = {(cx - w / 2 - left) / sx, (cy - h / 2 - top) / sy, (cx + w / 2 - left) / sx, (cy + h / 2 - top) / sy};
    if (image)
      for (int k = 0; k < 4; ++k) box[k] = std::min(std::max(box[k], 0.0), double(k % 2 ? image_h : image_w));
    char coords[160], score[32];
    std::snprintf(coords, sizeof coords, "%.2f, %.2f, %.2f, %.2f", box[0], box[1], box[2], box[3]);
    std::snprintf(score, sizeof score, "%.4f", f.score);
    bool labelled = f.c >= 0 && f.c < int64_t(post.labels.size());
    std::string name = labelled ? post.labels[size_t(f.c)] : "class " + std::to_string(f.c);
    if (drawn) {  // the printed values, as run.py draws them (round(v, 2))
      Detection d{f.c, {0, 0, 0, 0}, LabelText(name, std::strtod(score, nullptr))};
      const char* at = coords;
      for (int k = 0; k < 4; ++k) {
        char* end = nullptr;
        d.box[k] = std::strtod(at, &end);
        at = end + (k < 3 ? 2 : 0);
      }
      drawn->push_back(d);
    }
    json += std::string(i ? ", " : "") + "{\"box\": [" + coords + "], \"score\": " + score + ", \"class\": " +
            std::to_string(f.c) + (labelled ? ", \"label\": " + JsonQuote(name) : std::string()) + "}";
    char line[256];
    std::snprintf(line, sizeof line, "%-16s %s  [%s]", name.c_str(), score, coords);
    *text += std::string(i ? "\n" : "") + line;
  }
  return "[" + json + "]";
}

// imaging.classify, printed as run.py prints it
std::string ClassifyJson(const HostTensor& t, const Postprocess& post, std::string* text) {
  std::vector<double> v(t.Count());
  for (size_t i = 0; i < v.size(); ++i) v[i] = ElementAsDouble(t.dtype, &t.data[i * size_t(t.dtype.bytes)]);
  if (post.softmax && !v.empty()) {
    double top = *std::max_element(v.begin(), v.end()), sum = 0;
    for (double& x : v) sum += (x = std::exp(x - top));
    for (double& x : v) x = x / sum;
  }
  std::vector<size_t> order(v.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] > v[b]; });
  order.resize(std::min(order.size(), size_t(post.top_k)));
  std::string json;
  for (size_t r = 0; r < order.size(); ++r) {
    size_t i = order[r];
    char score[64];
    std::snprintf(score, sizeof score, "%.4f", v[i]);
    json += std::string(r ? ", " : "") + "{\"index\": " + std::to_string(i) + ", \"score\": " + score +
            (i < post.labels.size() ? ", \"label\": " + JsonQuote(post.labels[i]) : std::string()) + "}";
    char line[64];
    std::snprintf(line, sizeof line, "%2zu. %.4f  ", r + 1, v[i]);
    *text += std::string(r ? "\n" : "") + line +
             (i < post.labels.size() ? post.labels[i] + " (" + std::to_string(i) + ")" : "class " + std::to_string(i));
  }
  return "[" + json + "]";
}

}  // namespace
