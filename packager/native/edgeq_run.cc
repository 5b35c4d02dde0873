// edgeq-run: the native loader of an edgeq bundle. Needs no Python, numpy or pip on the device.
//
//   runtime/edgeq-run --check                      this machine can run the bundle
//   runtime/edgeq-run --self-test [--json]         golden input -> outputs recorded at build time
//   runtime/edgeq-run --input NAME=x.npy ... [--output DIR_OR_FILE.npz] [--json]
//   runtime/edgeq-run --benchmark N [--warmup W] [--json]
//
// Same flags, JSON keys, statistics (contract.latency_statistics) and exit codes as run.py (contract.LoaderExit):
// 0 ok, 1 self-test failed, 2 usage (flags, inputs, outputs), 4 this machine cannot run the bundle, 7 the
// bundle is damaged, changed or refused; each refusal is one line on stderr naming the problem. Before any TVM library is loaded: the manifest is read (size and nesting
// bounded), its signature checked when this device trusts a key ($EDGEQ_TRUSTED_KEY, else
// /etc/edgeq/trusted.pub; ed25519 through the system's OpenSSL libcrypto), the architecture compared,
// every file's size and SHA-256 checked, and for CUDA bundles the driver looked for. Only then are the
// bundled runtime libraries loaded (runtime/, by absolute path) and the model run through tvm-ffi's C ABI.
// The binary itself links nothing but the C/C++ runtime, so every refusal above is a line, not a loader
// error.
#include <dlfcn.h>
#include <sched.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <tvm/ffi/c_api.h>

namespace {

constexpr int kSchemaVersion = EDGEQ_SCHEMA_VERSION;
constexpr size_t kMaxManifestBytes = 4u << 20;
constexpr int kMaxJsonDepth = 64;
constexpr uint64_t kMaxInputBytes = 4ull << 30;  // one .npy input; raise with EDGEQ_MAX_INPUT_BYTES

enum Exit { kOk = 0, kSelfTestFailed = 1, kUsage = 2, kDevice = 4, kBundle = 7 };  // contract.LoaderExit

struct Refused : std::runtime_error {
  Refused(const std::string& why, int status) : std::runtime_error(why), status(status) {}
  int status;
};
// The bundle is damaged, changed, unsigned where a key is trusted, or not one this loader reads.
[[noreturn]] void refuse(const std::string& why) { throw Refused(why, kBundle); }
// This machine cannot run the bundle: architecture, driver, GPU, libraries.
[[noreturn]] void refuse_device(const std::string& why) { throw Refused(why, kDevice); }
// The user's flags, inputs or output path.
[[noreturn]] void refuse_usage(const std::string& why) { throw Refused(why, kUsage); }

// ------------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4)
// ------------------------------------------------------------------------------------------------
class Sha256 {
 public:
  Sha256() { Reset(); }
  void Reset() {
    static const uint32_t init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::memcpy(h_, init, sizeof h_);
    len_ = 0;
    fill_ = 0;
  }
  void Update(const uint8_t* data, size_t n) {
    len_ += n;
    while (n > 0) {
      size_t take = std::min(n, size_t(64) - fill_);
      std::memcpy(buf_ + fill_, data, take);
      fill_ += take;
      data += take;
      n -= take;
      if (fill_ == 64) {
        Block(buf_);
        fill_ = 0;
      }
    }
  }
  std::string HexDigest() {
    uint64_t bits = len_ * 8;
    uint8_t pad = 0x80;
    Update(&pad, 1);
    uint8_t zero = 0;
    while (fill_ != 56) Update(&zero, 1);
    uint8_t lenbuf[8];
    for (int i = 0; i < 8; ++i) lenbuf[i] = uint8_t(bits >> (56 - 8 * i));
    Update(lenbuf, 8);
    std::string out;
    char hex[9];
    for (uint32_t v : h_) {
      std::snprintf(hex, sizeof hex, "%08x", v);
      out += hex;
    }
    return out;
  }

 private:
  static uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
  void Block(const uint8_t* p) {
    static const uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 | uint32_t(p[4 * i + 2]) << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = Rotr(w[i - 15], 7) ^ Rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = Rotr(w[i - 2], 17) ^ Rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h_[0] += a; h_[1] += b; h_[2] += c; h_[3] += d; h_[4] += e; h_[5] += f; h_[6] += g; h_[7] += h;
  }
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t fill_;
  uint64_t len_;
};

std::string Sha256File(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return "";
  Sha256 sha;
  std::vector<uint8_t> buf(1 << 20);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) sha.Update(buf.data(), n);
  std::fclose(f);
  return sha.HexDigest();
}

// ------------------------------------------------------------------------------------------------
// Files
// ------------------------------------------------------------------------------------------------
std::string ReadFile(const std::string& path, size_t limit, const std::string& what) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) refuse("cannot read " + what + " (" + path + ")");
  if (size_t(st.st_size) > limit) refuse(what + " is larger than " + std::to_string(limit) + " bytes");
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) refuse("cannot read " + what + " (" + path + ")");
  std::string data(size_t(st.st_size), '\0');
  size_t got = data.empty() ? 0 : std::fread(&data[0], 1, data.size(), f);
  std::fclose(f);
  if (got != data.size()) refuse("cannot read " + what + " (" + path + ")");
  return data;
}

bool IsFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// ------------------------------------------------------------------------------------------------
// JSON: a small reader with bounded nesting (hostile manifests must not exhaust the stack)
// ------------------------------------------------------------------------------------------------
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool b = false;
  double num = 0;
  bool integral = false;
  int64_t i = 0;
  std::string str;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;

  const Json* Find(const std::string& key) const {
    if (kind != kObject) return nullptr;
    for (auto& kv : fields)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
  const Json& At(const std::string& key, const std::string& where) const {
    const Json* v = Find(key);
    if (!v) refuse("manifest field '" + where + key + "' is missing");
    return *v;
  }
  const std::string& Str(const std::string& where) const {
    if (kind != kString) refuse("manifest field '" + where + "' is not a string");
    return str;
  }
  int64_t Int(const std::string& where) const {
    if (kind != kNumber || !integral) refuse("manifest field '" + where + "' is not an integer");
    return i;
  }
  double Num(const std::string& where) const {
    if (kind != kNumber) refuse("manifest field '" + where + "' is not a number");
    return num;
  }
  const std::vector<Json>& Arr(const std::string& where) const {
    if (kind != kArray) refuse("manifest field '" + where + "' is not a list");
    return items;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}
  Json Parse() {
    CheckUtf8();  // the manifest is what the signature covers: every reader must see the same text (Python: strict UTF-8)
    Json v = Value(0);
    Space();
    if (p_ != s_.size()) Fail("trailing data");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& why) {
    refuse("manifest.json is not valid JSON (" + why + " at byte " + std::to_string(p_) + ")");
  }
  // Strict UTF-8 as Python decodes it: no overlong forms, no surrogates, nothing above U+10FFFF.
  void CheckUtf8() {
    const auto* b = reinterpret_cast<const uint8_t*>(s_.data());
    size_t n = s_.size();
    for (size_t i = 0; i < n;) {
      uint8_t c = b[i];
      size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
      if (len == 0 || i + len > n) { p_ = i; Fail("not UTF-8 text"); }
      uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
      for (size_t k = 1; k < len; ++k) {
        if ((b[i + k] & 0xC0) != 0x80) { p_ = i; Fail("not UTF-8 text"); }
        cp = (cp << 6) | (b[i + k] & 0x3F);
      }
      static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
      if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) { p_ = i; Fail("not UTF-8 text"); }
      i += len;
    }
  }
  void Space() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\n' || s_[p_] == '\r' || s_[p_] == '\t')) ++p_;
  }
  bool Eat(const char* word) {
    size_t n = std::strlen(word);
    if (s_.compare(p_, n, word) == 0) {
      p_ += n;
      return true;
    }
    return false;
  }
  Json Value(int depth) {
    if (depth > kMaxJsonDepth) Fail("nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    Space();
    if (p_ >= s_.size()) Fail("unexpected end");
    Json v;
    char c = s_[p_];
    if (c == '{') {
      v.kind = Json::kObject;
      ++p_;
      Space();
      if (p_ < s_.size() && s_[p_] == '}') {
        ++p_;
        return v;
      }
      while (true) {
        Space();
        if (p_ >= s_.size() || s_[p_] != '"') Fail("expected a key");
        size_t key_at = p_;
        std::string key = String();
        for (auto& kv : v.fields) {  // first-wins and last-wins readers would see different documents
          if (kv.first == key) { p_ = key_at; Fail("duplicate key \"" + key + "\""); }
        }
        Space();
        if (p_ >= s_.size() || s_[p_] != ':') Fail("expected ':'");
        ++p_;
        v.fields.emplace_back(std::move(key), Value(depth + 1));
        Space();
        if (p_ < s_.size() && s_[p_] == ',') { ++p_; continue; }
        if (p_ < s_.size() && s_[p_] == '}') { ++p_; return v; }
        Fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind = Json::kArray;
      ++p_;
      Space();
      if (p_ < s_.size() && s_[p_] == ']') {
        ++p_;
        return v;
      }
      while (true) {
        v.items.push_back(Value(depth + 1));
        Space();
        if (p_ < s_.size() && s_[p_] == ',') { ++p_; continue; }
        if (p_ < s_.size() && s_[p_] == ']') { ++p_; return v; }
        Fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.kind = Json::kString;
      v.str = String();
      return v;
    }
    if (Eat("true")) { v.kind = Json::kBool; v.b = true; return v; }
    if (Eat("false")) { v.kind = Json::kBool; return v; }
    if (Eat("null")) return v;
    // what Python's json writes for non-finite floats (a quantization report may hold them)
    if (Eat("NaN")) { v.kind = Json::kNumber; v.num = NAN; return v; }
    if (Eat("Infinity")) { v.kind = Json::kNumber; v.num = INFINITY; return v; }
    if (Eat("-Infinity")) { v.kind = Json::kNumber; v.num = -INFINITY; return v; }
    return Number();
  }
  Json Number() {
    size_t start = p_;
    if (p_ < s_.size() && s_[p_] == '-') ++p_;
    bool integral = true;
    while (p_ < s_.size() && (std::isdigit(uint8_t(s_[p_])) || s_[p_] == '.' || s_[p_] == 'e' || s_[p_] == 'E' ||
                              s_[p_] == '+' || s_[p_] == '-')) {
      if (!std::isdigit(uint8_t(s_[p_]))) integral = false;
      ++p_;
    }
    if (p_ == start) Fail("unexpected character");
    std::string text = s_.substr(start, p_ - start);
    Json v;
    v.kind = Json::kNumber;
    char* end = nullptr;
    v.num = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size()) Fail("bad number");
    if (integral) {
      errno = 0;
      v.i = std::strtoll(text.c_str(), nullptr, 10);
      v.integral = errno == 0;
    }
    return v;
  }
  std::string String() {
    ++p_;  // opening quote
    std::string out;
    while (true) {
      if (p_ >= s_.size()) Fail("unterminated string");
      char c = s_[p_++];
      if (c == '"') return out;
      if (uint8_t(c) < 0x20) Fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (p_ >= s_.size()) Fail("unterminated string");
      char e = s_[p_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = Hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (!Eat("\\u")) Fail("lone surrogate");
            uint32_t lo = Hex4();
            if (lo < 0xDC00 || lo >= 0xE000) Fail("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          Utf8(cp, &out);
          break;
        }
        default: Fail("bad escape");
      }
    }
  }
  uint32_t Hex4() {
    if (p_ + 4 > s_.size()) Fail("bad \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = s_[p_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') v |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= uint32_t(c - 'A' + 10);
      else Fail("bad \\u escape");
    }
    return v;
  }
  static void Utf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) { *out += char(cp); return; }
    if (cp < 0x800) { *out += char(0xC0 | (cp >> 6)); *out += char(0x80 | (cp & 0x3F)); return; }
    if (cp < 0x10000) {
      *out += char(0xE0 | (cp >> 12)); *out += char(0x80 | ((cp >> 6) & 0x3F)); *out += char(0x80 | (cp & 0x3F));
      return;
    }
    *out += char(0xF0 | (cp >> 18)); *out += char(0x80 | ((cp >> 12) & 0x3F));
    *out += char(0x80 | ((cp >> 6) & 0x3F)); *out += char(0x80 | (cp & 0x3F));
  }
  const std::string& s_;
  size_t p_ = 0;
};

std::string JsonQuote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') { out += '\\'; out += c; }
    else if (uint8_t(c) < 0x20) { char buf[8]; std::snprintf(buf, sizeof buf, "\\u%04x", c); out += buf; }
    else out += c;
  }
  return out + "\"";
}

std::string JsonNumber(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  for (int digits = 15; digits <= 17; ++digits) {  // the shortest text that reads back as the same double
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// ------------------------------------------------------------------------------------------------
// Tensors on the host: dtypes, float16, .npy in and out, .npz (stored zip) out
// ------------------------------------------------------------------------------------------------
struct DType {
  std::string name;  // numpy's name: float32, int8, bool, ...
  char kind;         // 'f', 'i', 'u', 'b'
  int bytes;
};

DType ParseDType(const std::string& name) {
  static const std::map<std::string, DType> known = {
      {"float16", {"float16", 'f', 2}}, {"float32", {"float32", 'f', 4}}, {"float64", {"float64", 'f', 8}},
      {"int8", {"int8", 'i', 1}},       {"int16", {"int16", 'i', 2}},     {"int32", {"int32", 'i', 4}},
      {"int64", {"int64", 'i', 8}},     {"uint8", {"uint8", 'u', 1}},     {"uint16", {"uint16", 'u', 2}},
      {"uint32", {"uint32", 'u', 4}},   {"uint64", {"uint64", 'u', 8}},   {"bool", {"bool", 'b', 1}}};
  auto it = known.find(name);
  if (it == known.end()) refuse("dtype '" + name + "' is not one edgeq-run handles");
  return it->second;
}

std::string NpyDescr(const DType& t) {
  if (t.kind == 'b') return "|b1";
  std::string order = t.bytes == 1 ? "|" : "<";
  return order + t.kind + std::to_string(t.bytes);
}

double HalfToDouble(uint16_t h) {
  int sign = h >> 15, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  double v;
  if (exp == 0) v = std::ldexp(double(mant), -24);
  else if (exp == 31) v = mant ? NAN : INFINITY;
  else v = std::ldexp(double(mant | 0x400), exp - 25);
  return sign ? -v : v;
}

double ElementAsDouble(const DType& t, const uint8_t* p) {
  switch (t.kind) {
    case 'f':
      if (t.bytes == 2) { uint16_t h; std::memcpy(&h, p, 2); return HalfToDouble(h); }
      if (t.bytes == 4) { float f; std::memcpy(&f, p, 4); return f; }
      { double d; std::memcpy(&d, p, 8); return d; }
    case 'b': return *p ? 1.0 : 0.0;
    case 'i':
      if (t.bytes == 1) return double(int8_t(*p));
      if (t.bytes == 2) { int16_t v; std::memcpy(&v, p, 2); return v; }
      if (t.bytes == 4) { int32_t v; std::memcpy(&v, p, 4); return v; }
      { int64_t v; std::memcpy(&v, p, 8); return double(v); }
    default:
      if (t.bytes == 1) return *p;
      if (t.bytes == 2) { uint16_t v; std::memcpy(&v, p, 2); return v; }
      if (t.bytes == 4) { uint32_t v; std::memcpy(&v, p, 4); return v; }
      { uint64_t v; std::memcpy(&v, p, 8); return double(v); }
  }
}

struct HostTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
  size_t Count() const {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    return n;
  }
};

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out;
  for (size_t k = 0; k < shape.size(); ++k) out += (k ? "x" : "") + std::to_string(shape[k]);
  return out;
}

// Reads a .npy file (version 1-3, little-endian, C order) with the size bounded before allocation.
HostTensor ReadNpy(const std::string& path, const std::string& what) {
  auto fail = [&](const std::string& why) { refuse_usage("cannot read " + what + ": " + why); };
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail(std::strerror(errno));
  std::unique_ptr<FILE, int (*)(FILE*)> guard(f, std::fclose);
  uint8_t head[10];
  if (std::fread(head, 1, 10, f) != 10 || std::memcmp(head, "\x93NUMPY", 6) != 0)
    fail("not a .npy file");
  uint32_t hlen;
  if (head[6] == 1) {
    hlen = head[8] | (head[9] << 8);
  } else if (head[6] == 2 || head[6] == 3) {
    uint8_t more[2];
    if (std::fread(more, 1, 2, f) != 2) fail("truncated");
    hlen = head[8] | (head[9] << 8) | (uint32_t(more[0]) << 16) | (uint32_t(more[1]) << 24);
  } else {
    fail("unknown .npy version");
  }
  if (hlen > 65536) fail(".npy header larger than 64 KiB");
  std::string header(hlen, '\0');
  if (std::fread(&header[0], 1, hlen, f) != hlen) fail("truncated");
  auto value_of = [&](const std::string& key) -> std::string {
    size_t k = header.find("'" + key + "'");
    if (k == std::string::npos) fail(".npy header has no '" + key + "'");
    size_t colon = header.find(':', k);
    if (colon == std::string::npos) fail("malformed .npy header");
    size_t start = header.find_first_not_of(' ', colon + 1);
    size_t end = header[start] == '(' ? header.find(')', start) + 1
                 : header[start] == '\'' ? header.find('\'', start + 1) + 1
                                         : header.find_first_of(",}", start);
    if (start == std::string::npos || end == std::string::npos || end <= start)
      fail("malformed .npy header");
    return header.substr(start, end - start);
  };
  std::string descr = value_of("descr"), fortran = value_of("fortran_order"), shape = value_of("shape");
  if (fortran != "False") fail("Fortran order; save it C-contiguous (np.ascontiguousarray)");
  static const std::map<std::string, std::string> names = {
      {"'<f2'", "float16"}, {"'<f4'", "float32"}, {"'<f8'", "float64"}, {"'|i1'", "int8"},  {"'<i2'", "int16"},
      {"'<i4'", "int32"},   {"'<i8'", "int64"},   {"'|u1'", "uint8"},   {"'<u2'", "uint16"}, {"'<u4'", "uint32"},
      {"'<u8'", "uint64"},  {"'|b1'", "bool"}};
  auto it = names.find(descr);
  if (it == names.end()) fail("dtype " + descr + " is not one edgeq-run reads (little-endian numbers only)");
  HostTensor t;
  t.dtype = ParseDType(it->second);
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')') fail("malformed .npy shape");
  std::string dims = shape.substr(1, shape.size() - 2);
  uint64_t count = 1;
  size_t p = 0;
  while (p < dims.size()) {
    size_t q = dims.find(',', p);
    std::string part = dims.substr(p, q == std::string::npos ? std::string::npos : q - p);
    part.erase(0, part.find_first_not_of(' '));
    part.erase(part.find_last_not_of(' ') + 1);
    if (!part.empty()) {
      if (part.size() > 12 || part.find_first_not_of("0123456789") != std::string::npos)
        fail("malformed .npy shape");
      int64_t d = std::stoll(part);
      t.shape.push_back(d);
      count *= uint64_t(d);
      if (count > kMaxInputBytes) break;
    }
    if (q == std::string::npos) break;
    p = q + 1;
  }
  uint64_t limit = kMaxInputBytes;
  if (const char* env = std::getenv("EDGEQ_MAX_INPUT_BYTES")) limit = std::strtoull(env, nullptr, 10);
  if (count * uint64_t(t.dtype.bytes) > limit)
    fail("it declares more than " + std::to_string(limit) + " bytes; raise EDGEQ_MAX_INPUT_BYTES to read it");
  t.data.resize(size_t(count) * size_t(t.dtype.bytes));
  if (!t.data.empty() && std::fread(t.data.data(), 1, t.data.size(), f) != t.data.size())
    fail("less data than its header declares");
  return t;
}

std::string NpyBytes(const HostTensor& t) {
  std::string dims;
  for (int64_t d : t.shape) dims += std::to_string(d) + ", ";
  if (t.shape.size() > 1) dims.erase(dims.size() - 2);
  else if (t.shape.size() == 1) dims.erase(dims.size() - 1);
  std::string header = "{'descr': '" + NpyDescr(t.dtype) + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += char(header.size() & 0xFF);
  out += char(header.size() >> 8);
  out += header;
  out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  return out;
}

uint32_t Crc32(const std::string& data) {
  static uint32_t table[256];
  static bool ready = false;
  if (!ready) {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
    ready = true;
  }
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : data) c = table[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

void Put16(std::string* s, uint32_t v) { *s += char(v & 0xFF); *s += char((v >> 8) & 0xFF); }
void Put32(std::string* s, uint32_t v) { Put16(s, v & 0xFFFF); Put16(s, v >> 16); }

void WriteFileAtomic(const std::string& path, const std::string& data) {
  // a new file beside the target (never through a link someone left under the temporary name), renamed over
  // the target: a link at the target itself is replaced, not followed
  std::string tmp = path + ".tmp" + std::to_string(getpid());
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  FILE* f = fd >= 0 ? fdopen(fd, "wb") : nullptr;
  if (!f) {
    if (fd >= 0) close(fd);
    refuse_usage("cannot write " + path + ": " + std::strerror(errno));
  }
  bool ok = std::fwrite(data.data(), 1, data.size(), f) == data.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    refuse_usage("cannot write " + path + ": " + std::strerror(errno));
  }
}

// A .npz as numpy writes it: a zip of NAME.npy members, stored uncompressed.
void WriteNpz(const std::string& path, const std::vector<HostTensor>& tensors) {
  std::string out, central;
  for (const HostTensor& t : tensors) {
    std::string name = t.name + ".npy", data = NpyBytes(t);
    if (data.size() >= 0xFFFFFFFFu) refuse_usage("output " + t.name + " is too large for a .npz; write a directory instead");
    uint32_t crc = Crc32(data), offset = uint32_t(out.size());
    std::string common;
    Put16(&common, 20); Put16(&common, 0); Put16(&common, 0); Put16(&common, 0); Put16(&common, 0x21);
    Put32(&common, crc); Put32(&common, uint32_t(data.size())); Put32(&common, uint32_t(data.size()));
    Put16(&common, uint32_t(name.size())); Put16(&common, 0);
    out += std::string("PK\x03\x04", 4) + common + name + data;
    central += std::string("PK\x01\x02", 4);
    Put16(&central, 20);
    central += common;
    Put16(&central, 0); Put16(&central, 0); Put16(&central, 0); Put32(&central, 0); Put32(&central, offset);
    central += name;
  }
  uint32_t cd_offset = uint32_t(out.size());
  out += central;
  out += std::string("PK\x05\x06", 4);
  Put16(&out, 0); Put16(&out, 0); Put16(&out, uint32_t(tensors.size())); Put16(&out, uint32_t(tensors.size()));
  Put32(&out, uint32_t(central.size())); Put32(&out, cd_offset); Put16(&out, 0);
  WriteFileAtomic(path, out);
}

std::string SafeFileName(const std::string& name) {
  std::string out;
  for (char c : name) out += (std::isalnum(uint8_t(c)) || c == '.' || c == '_' || c == '-') ? c : '_';
  if (out.empty() || out[0] == '.') out = "_" + out;
  return out;
}

// ------------------------------------------------------------------------------------------------
// Signature: ed25519 over manifest.json, verified with the system's OpenSSL (libcrypto) when a key is trusted
// ------------------------------------------------------------------------------------------------
std::string Base64Decode(const std::string& in, const std::string& what) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    int v;
    if (c >= 'A' && c <= 'Z') v = c - 'A';
    else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
    else if (c >= '0' && c <= '9') v = c - '0' + 52;
    else if (c == '+') v = 62;
    else if (c == '/') v = 63;
    else if (c == '=' || c == '\n' || c == '\r') continue;
    else refuse(what + " is not base64");
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += char((acc >> bits) & 0xFF);
    }
  }
  return out;
}

void CheckSignature(const std::string& bundle, const std::string& manifest_bytes) {
  const char* env = std::getenv("EDGEQ_TRUSTED_KEY");
  std::string key_path = env && *env ? env : "/etc/edgeq/trusted.pub";
  if (!IsFile(key_path)) return;
  std::string pem = ReadFile(key_path, 64 << 10, "the trusted key " + key_path);
  size_t b = pem.find("-----BEGIN PUBLIC KEY-----"), e = pem.find("-----END PUBLIC KEY-----");
  if (b == std::string::npos || e == std::string::npos || e < b) refuse("the trusted key " + key_path + " is not a PEM public key");
  std::string der = Base64Decode(pem.substr(b + 26, e - b - 26), "the trusted key " + key_path);
  static const unsigned char prefix[12] = {0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00};
  if (der.size() != 44 || std::memcmp(der.data(), prefix, 12) != 0)
    refuse("the trusted key " + key_path + " is not an ed25519 public key");
  std::string raw = der.substr(12);
  Sha256 sha;
  sha.Update(reinterpret_cast<const uint8_t*>(raw.data()), raw.size());
  std::string key_id = sha.HexDigest().substr(0, 16);
  std::string sig_path = bundle + "/manifest.sig";
  if (!IsFile(sig_path)) refuse("this device trusts " + key_path + " but the bundle is not signed (no manifest.sig)");
  Json sig;
  try {
    sig = JsonParser(ReadFile(sig_path, 1 << 20, "manifest.sig")).Parse();
  } catch (const Refused&) {
    refuse("manifest.sig is malformed");
  }
  const Json* alg = sig.Find("algorithm");
  const Json* kid = sig.Find("key_id");
  const Json* value = sig.Find("signature");
  if (!alg || alg->kind != Json::kString || alg->str != "ed25519" || !kid || kid->kind != Json::kString || !value ||
      value->kind != Json::kString)
    refuse("manifest.sig is malformed");
  if (kid->str != key_id)
    refuse("the bundle is signed by another key (" + kid->str + ") than the trusted one (" + key_id + ")");
  std::string signature = Base64Decode(value->str, "manifest.sig");
  if (signature.size() != 64) refuse("manifest.sig is malformed");
  void* crypto = nullptr;
  for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1"})
    if ((crypto = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
  if (!crypto)
    refuse("a trusted key is configured (" + key_path + ") but OpenSSL's libcrypto (libcrypto.so.3) is missing; install libssl3");
  using NewRaw = void* (*)(int, void*, const unsigned char*, size_t);
  using CtxNew = void* (*)();
  using CtxFree = void (*)(void*);
  using KeyFree = void (*)(void*);
  using VerifyInit = int (*)(void*, void**, const void*, void*, void*);
  using Verify = int (*)(void*, const unsigned char*, size_t, const unsigned char*, size_t);
  auto new_raw = reinterpret_cast<NewRaw>(dlsym(crypto, "EVP_PKEY_new_raw_public_key"));
  auto ctx_new = reinterpret_cast<CtxNew>(dlsym(crypto, "EVP_MD_CTX_new"));
  auto ctx_free = reinterpret_cast<CtxFree>(dlsym(crypto, "EVP_MD_CTX_free"));
  auto key_free = reinterpret_cast<KeyFree>(dlsym(crypto, "EVP_PKEY_free"));
  auto verify_init = reinterpret_cast<VerifyInit>(dlsym(crypto, "EVP_DigestVerifyInit"));
  auto verify = reinterpret_cast<Verify>(dlsym(crypto, "EVP_DigestVerify"));
  if (!new_raw || !ctx_new || !ctx_free || !key_free || !verify_init || !verify)
    refuse("the system's libcrypto has no ed25519 support (OpenSSL 1.1.1 or newer is needed)");
  constexpr int kEvpPkeyEd25519 = 1087;  // NID_ED25519
  void* pkey = new_raw(kEvpPkeyEd25519, nullptr, reinterpret_cast<const unsigned char*>(raw.data()), raw.size());
  void* ctx = ctx_new();
  int ok = pkey && ctx && verify_init(ctx, nullptr, nullptr, nullptr, pkey) == 1 &&
           verify(ctx, reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                  reinterpret_cast<const unsigned char*>(manifest_bytes.data()), manifest_bytes.size()) == 1;
  if (ctx) ctx_free(ctx);
  if (pkey) key_free(pkey);
  if (!ok) refuse("the signature does not match manifest.json (changed after signing?)");
}

// ------------------------------------------------------------------------------------------------
// The bundle: manifest, files, machine
// ------------------------------------------------------------------------------------------------
struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t offset = 0, bytes = 0;  // inside a raw tensor file
};

std::vector<int64_t> ParseShape(const Json& j, const std::string& where) {
  std::vector<int64_t> shape;
  uint64_t count = 1;
  for (const Json& d : j.Arr(where)) {
    int64_t v = d.Int(where);
    if (v < 0 || v > (int64_t(1) << 40)) refuse("manifest field '" + where + "' has a bad size");
    count *= uint64_t(v);
    if (count > (uint64_t(1) << 40)) refuse("manifest field '" + where + "' is too large");
    shape.push_back(v);
  }
  return shape;
}

std::vector<TensorSpec> ParseSpecs(const Json& list, const std::string& where, bool raw) {
  std::vector<TensorSpec> out;
  for (const Json& item : list.Arr(where)) {
    TensorSpec s;
    s.name = item.At("name", where + ".").Str(where + ".name");
    s.dtype = ParseDType(item.At("dtype", where + ".").Str(where + ".dtype"));
    s.shape = ParseShape(item.At("shape", where + "."), where + ".shape");
    if (raw) {
      int64_t off = item.At("offset", where + ".").Int(where + ".offset");
      int64_t n = item.At("bytes", where + ".").Int(where + ".bytes");
      uint64_t count = 1;
      for (int64_t d : s.shape) count *= uint64_t(d);
      if (off < 0 || n < 0 || uint64_t(n) != count * uint64_t(s.dtype.bytes))
        refuse("manifest field '" + where + "' of " + s.name + " has a bad offset or size");
      s.offset = uint64_t(off);
      s.bytes = uint64_t(n);
    }
    out.push_back(s);
  }
  return out;
}

struct Bundle {
  std::string dir;
  std::string manifest_bytes;
  Json manifest;
  std::string bundle_id, arch, profile, cuda_arch;
  int cuda_major = 0;
  double rtol = 0, atol = 0;
  std::vector<TensorSpec> inputs, outputs, weights, golden;
  std::string weights_file, golden_file, library_file;
  std::vector<std::string> libraries;  // runtime libraries in load order, relative to dir
  std::string bridge;                  // runtime/libcudart.so.13 when the bundle carries the CUDA 12 bridge
};

Bundle LoadManifest(const std::string& dir) {
  Bundle b;
  b.dir = dir;
  b.manifest_bytes = ReadFile(dir + "/manifest.json", kMaxManifestBytes, "manifest.json");
  CheckSignature(dir, b.manifest_bytes);
  b.manifest = JsonParser(b.manifest_bytes).Parse();
  const Json& m = b.manifest;
  if (m.kind != Json::kObject) refuse("manifest.json is not a JSON object");
  int64_t schema = m.At("schema_version", "").Int("schema_version");
  if (schema != kSchemaVersion)
    refuse("manifest schema_version " + std::to_string(schema) + " is not " + std::to_string(kSchemaVersion) +
           "; use the edgeq-run shipped with this bundle");
  b.bundle_id = m.At("bundle_id", "").Str("bundle_id");
  const Json& device = m.At("device", "");
  b.arch = device.At("arch", "device.").Str("device.arch");
  b.profile = device.At("profile", "device.").Str("device.profile");
  const Json* cuda = device.Find("cuda_arch");
  if (cuda && cuda->kind == Json::kString) {
    b.cuda_arch = cuda->str;
    const Json& toolkit = m.At("toolchain", "").At("cuda_toolkit", "toolchain.");
    b.cuda_major = std::atoi(toolkit.At("version", "toolchain.cuda_toolkit.").Str("toolchain.cuda_toolkit.version").c_str());
  }
  b.inputs = ParseSpecs(m.At("inputs", ""), "inputs", false);
  b.outputs = ParseSpecs(m.At("outputs", ""), "outputs", false);
  const Json& weights = m.At("weights", "");
  const Json& golden = m.At("golden", "");
  for (const Json* section : {&weights, &golden}) {
    const Json* format = section->Find("format");
    if (!format || format->kind != Json::kString || format->str != "edgeq-raw-1")
      refuse("this bundle's tensors are not in the edgeq-raw-1 form edgeq-run reads; package it again");
  }
  b.weights_file = weights.At("file", "weights.").Str("weights.file");
  b.golden_file = golden.At("file", "golden.").Str("golden.file");
  b.weights = ParseSpecs(weights.At("tensors", "weights."), "weights.tensors", true);
  b.golden = ParseSpecs(golden.At("tensors", "golden."), "golden.tensors", true);
  // every table entry inside its file as the manifest sizes it (CheckFiles holds the files to those sizes), so
  // nothing is allocated for a range that is not there (the Python readers check the same in safebundle)
  const Json& sizes = m.At("sizes", "");
  for (auto* table : {&b.weights, &b.golden}) {
    const std::string& file = table == &b.weights ? b.weights_file : b.golden_file;
    const Json* size = sizes.Find(file);
    if (!size || size->kind != Json::kNumber || !size->integral || size->i < 0)
      refuse("manifest sizes." + file + " is missing or not a size");
    for (const TensorSpec& t : *table)
      if (t.offset > uint64_t(size->i) || t.bytes > uint64_t(size->i) - t.offset)
        refuse("manifest table entry " + t.name + " lies beyond the end of " + file);
  }
  b.rtol = golden.At("rtol", "golden.").Num("golden.rtol");
  b.atol = golden.At("atol", "golden.").Num("golden.atol");
  b.library_file = m.At("library", "").At("file", "library.").Str("library.file");
  const Json* runtime = m.Find("runtime");
  if (!runtime || runtime->kind != Json::kObject) refuse_device("this bundle carries no runtime (packaged with --runtime none)");
  for (const Json& lib : runtime->At("libraries", "runtime.").Arr("runtime.libraries"))
    b.libraries.push_back(lib.Str("runtime.libraries"));
  const Json* bridge = runtime->Find("cuda_bridge");
  if (bridge && bridge->kind == Json::kObject) b.bridge = bridge->At("file", "runtime.cuda_bridge.").Str("runtime.cuda_bridge.file");
  return b;
}

void CheckArch(const Bundle& b) {
  struct utsname u;
  uname(&u);
  if (b.arch != u.machine)
    refuse_device("this bundle is for " + b.arch + " (" + b.profile + ") but this machine is " + std::string(u.machine));
}

void CheckFiles(const Bundle& b) {
  const Json& files = b.manifest.At("files", "");
  const Json& sizes = b.manifest.At("sizes", "");
  if (files.kind != Json::kObject || sizes.kind != Json::kObject) refuse("manifest 'files' and 'sizes' must be objects");
  for (auto& kv : files.fields) {
    const std::string& name = kv.first;
    if (name.empty() || name[0] == '/' || name.find("..") != std::string::npos)
      refuse("manifest lists an unsafe file name '" + name + "'");
    std::string path = b.dir + "/" + name;
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) refuse("bundle file " + name + " is missing");
    const Json* size = sizes.Find(name);
    if (!size || size->kind != Json::kNumber || !size->integral || size->i != int64_t(st.st_size) ||
        Sha256File(path) != kv.second.Str("files." + name))
      refuse("bundle file " + name + " does not match its SHA-256 in the manifest; re-copy the bundle");
  }
}

// The CUDA driver: present and new enough for the toolkit the device code was built with.
void CheckDriver(const Bundle& b) {
  void* libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!libcuda) refuse_device("this bundle needs a CUDA GPU (" + b.cuda_arch + ") but no CUDA driver (libcuda.so.1) was found");
  using GetVersion = int (*)(int*);
  auto get_version = reinterpret_cast<GetVersion>(dlsym(libcuda, "cuDriverGetVersion"));
  int version = 0;
  if (get_version && get_version(&version) == 0 && version > 0 && version / 1000 < b.cuda_major)
    refuse_device("this bundle was built with CUDA " + std::to_string(b.cuda_major) + ".x but the driver here is CUDA " +
           std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10) + "; it needs a CUDA " +
           std::to_string(b.cuda_major) + ".x driver or newer");
}

// ------------------------------------------------------------------------------------------------
// tvm-ffi through its C ABI, from the bundled libtvm_ffi.so
// ------------------------------------------------------------------------------------------------
struct Ffi {
  decltype(&TVMFFIFunctionGetGlobal) get_global = nullptr;
  decltype(&TVMFFIFunctionCall) call = nullptr;
  decltype(&TVMFFIObjectDecRef) dec_ref = nullptr;
  decltype(&TVMFFIErrorMoveFromRaised) move_error = nullptr;
  decltype(&TVMFFIDataTypeFromString) dtype_from_string = nullptr;
};
Ffi ffi;

// An owned Any: releases its object reference.
struct Value {
  TVMFFIAny any{};
  Value() { any.type_index = kTVMFFINone; }
  Value(const Value&) = delete;
  Value& operator=(const Value&) = delete;
  Value(Value&& o) noexcept : any(o.any) { o.any.type_index = kTVMFFINone; }
  Value& operator=(Value&& o) noexcept {
    std::swap(any, o.any);
    return *this;
  }
  ~Value() {
    if (any.type_index >= kTVMFFIStaticObjectBegin && any.v_obj) ffi.dec_ref(any.v_obj);
  }
  void* obj() const { return any.type_index >= kTVMFFIStaticObjectBegin ? any.v_obj : nullptr; }
};

[[noreturn]] void RaiseFfiError(const std::string& what) {
  void* err = nullptr;
  ffi.move_error(&err);
  std::string message = what + " failed";
  if (err) {
    TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
    std::string kind(cell->kind.data, cell->kind.size), text(cell->message.data, cell->message.size);
    text = text.substr(0, text.find('\n'));
    message += ": " + kind + ": " + text;
    ffi.dec_ref(err);
  }
  refuse(message);
}

TVMFFIAny Int(int64_t v) { TVMFFIAny a{}; a.type_index = kTVMFFIInt; a.v_int64 = v; return a; }
TVMFFIAny Bool(bool v) { TVMFFIAny a{}; a.type_index = kTVMFFIBool; a.v_int64 = v; return a; }
TVMFFIAny Str(const char* s) { TVMFFIAny a{}; a.type_index = kTVMFFIRawStr; a.v_c_str = s; return a; }
TVMFFIAny Ptr(void* p) { TVMFFIAny a{}; a.type_index = kTVMFFIOpaquePtr; a.v_ptr = p; return a; }
TVMFFIAny None() { TVMFFIAny a{}; a.type_index = kTVMFFINone; return a; }
TVMFFIAny Dev(DLDevice d) { TVMFFIAny a{}; a.type_index = kTVMFFIDevice; a.v_device = d; return a; }
TVMFFIAny Dtype(DLDataType t) { TVMFFIAny a{}; a.type_index = kTVMFFIDataType; a.v_dtype = t; return a; }
TVMFFIAny Obj(const Value& v) { return v.any; }
TVMFFIAny TensorPtr(const Value& v) {
  TVMFFIAny a{};
  a.type_index = kTVMFFIDLTensorPtr;
  a.v_ptr = TVMFFITensorGetDLTensorPtr(v.obj());
  return a;
}

Value Call(void* func, std::vector<TVMFFIAny> args, const std::string& what) {
  Value out;
  if (ffi.call(func, args.data(), int32_t(args.size()), &out.any) != 0) RaiseFfiError(what);
  return out;
}

Value Global(const std::string& name) {
  TVMFFIByteArray bytes{name.data(), name.size()};
  Value out;
  void* handle = nullptr;
  if (ffi.get_global(&bytes, &handle) != 0) RaiseFfiError("looking up " + name);
  if (!handle) refuse("the bundled TVM runtime has no function " + name);
  out.any.type_index = kTVMFFIFunction;
  out.any.v_obj = static_cast<TVMFFIObject*>(handle);
  return out;
}

void* OpenLibrary(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!handle) {
    const char* err = dlerror();
    refuse_device("cannot load " + path + ": " + (err ? err : "unknown error"));
  }
  return handle;
}

struct Runtime {
  DLDevice dev{kDLCPU, 0};
  Value vm, main_fn, make_shape, alloc, copy_from, copy_to, sync;
  std::vector<Value> params;

  Value Tensor(const TensorSpec& spec, const uint8_t* data) {
    std::vector<TVMFFIAny> dims;
    for (int64_t d : spec.shape) dims.push_back(Int(d));
    Value shape = Call(make_shape.obj(), dims, "making a shape");
    DLDataType dtype;
    TVMFFIByteArray name{spec.dtype.name.data(), spec.dtype.name.size()};
    if (ffi.dtype_from_string(&name, &dtype) != 0) RaiseFfiError("dtype " + spec.dtype.name);
    Value t = Call(alloc.obj(), {Obj(shape), Dtype(dtype), Dev(dev), None()}, "allocating " + spec.name);
    Call(copy_from.obj(), {TensorPtr(t), Ptr(const_cast<uint8_t*>(data)), Int(int64_t(spec.bytes))},
         "copying " + spec.name + " to the device");
    return t;
  }

  void Sync() {
    if (dev.device_type != kDLCPU) Call(sync.obj(), {Dev(dev), Int(0)}, "synchronising the device");
  }

  // Runs main; returns the output tensors (borrowed references kept alive by `result`).
  std::vector<HostTensor> Run(const std::vector<Value>& inputs, const std::vector<TensorSpec>& specs) {
    std::vector<TVMFFIAny> args;
    for (const Value& v : inputs) args.push_back(Obj(v));
    for (const Value& v : params) args.push_back(Obj(v));
    Value result = Call(main_fn.obj(), args, "running the model");
    std::vector<const Value*> tensors;
    std::vector<Value> items;
    if (result.any.type_index == kTVMFFITensor) {
      tensors.push_back(&result);
    } else if (result.any.type_index == kTVMFFIArray) {
      auto* cell = reinterpret_cast<TVMFFISeqCell*>(reinterpret_cast<char*>(result.obj()) + sizeof(TVMFFIObject));
      auto* elems = static_cast<TVMFFIAny*>(cell->data);
      for (int64_t k = 0; k < cell->size; ++k) {
        if (elems[k].type_index != kTVMFFITensor) refuse("the model returned something other than tensors");
        tensors.push_back(reinterpret_cast<const Value*>(&elems[k]));  // borrowed from the array
      }
    } else {
      refuse("the model returned something other than tensors (type " + std::to_string(result.any.type_index) + ")");
    }
    if (tensors.size() != specs.size())
      refuse("the model returned " + std::to_string(tensors.size()) + " outputs, the manifest lists " +
             std::to_string(specs.size()));
    std::vector<HostTensor> out;
    for (size_t k = 0; k < specs.size(); ++k) {
      DLTensor* t = TVMFFITensorGetDLTensorPtr(tensors[k]->any.v_obj);
      HostTensor h;
      h.name = specs[k].name;
      h.dtype = specs[k].dtype;
      h.shape.assign(t->shape, t->shape + t->ndim);
      h.data.resize(h.Count() * size_t((t->dtype.bits * t->dtype.lanes + 7) / 8));
      TVMFFIAny dl{};
      dl.type_index = kTVMFFIDLTensorPtr;
      dl.v_ptr = t;
      Call(copy_to.obj(), {dl, Ptr(h.data.data()), Int(int64_t(h.data.size()))}, "copying " + h.name + " back");
      out.push_back(std::move(h));
    }
    return out;
  }
};

std::vector<uint8_t> ReadRange(const std::string& path, uint64_t offset, uint64_t bytes, const std::string& what) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) refuse("cannot read " + what);
  std::vector<uint8_t> data(bytes);
  bool ok = fseeko(f, off_t(offset), SEEK_SET) == 0 && (bytes == 0 || std::fread(data.data(), 1, bytes, f) == bytes);
  std::fclose(f);
  if (!ok) refuse(what + " is shorter than the manifest says");
  return data;
}

// Loads the bundled runtime (and, for CUDA bundles, the bridge and the GPU), the model and its weights.
std::unique_ptr<Runtime> LoadRuntime(const Bundle& b) {
  std::unique_ptr<Runtime> rt(new Runtime());
  // TVM's thread pool assumes two hardware threads per core and uses half the CPUs unless told; inference
  // gets every CPU this process may run on (TVM_NUM_THREADS still decides where set), as in run.py.
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof cpus, &cpus) == 0)
    setenv("TVM_NUM_THREADS", std::to_string(CPU_COUNT(&cpus)).c_str(), 0);
  void* ffi_lib = nullptr;
  for (const std::string& lib : b.libraries) {
    void* handle = OpenLibrary(b.dir + "/" + lib);
    if (lib.size() >= 13 && lib.compare(lib.size() - 13, 13, "libtvm_ffi.so") == 0) ffi_lib = handle;
    if (!b.bridge.empty() && lib == b.bridge) {
      using ErrorFn = const char* (*)();
      auto error = reinterpret_cast<ErrorFn>(dlsym(handle, "edgeq_cudart_bridge_error"));
      if (error && error()) refuse_device(error());
    }
  }
  if (!ffi_lib) refuse("the bundle's runtime has no libtvm_ffi.so");
  ffi.get_global = reinterpret_cast<decltype(ffi.get_global)>(dlsym(ffi_lib, "TVMFFIFunctionGetGlobal"));
  ffi.call = reinterpret_cast<decltype(ffi.call)>(dlsym(ffi_lib, "TVMFFIFunctionCall"));
  ffi.dec_ref = reinterpret_cast<decltype(ffi.dec_ref)>(dlsym(ffi_lib, "TVMFFIObjectDecRef"));
  ffi.move_error = reinterpret_cast<decltype(ffi.move_error)>(dlsym(ffi_lib, "TVMFFIErrorMoveFromRaised"));
  ffi.dtype_from_string = reinterpret_cast<decltype(ffi.dtype_from_string)>(dlsym(ffi_lib, "TVMFFIDataTypeFromString"));
  if (!ffi.get_global || !ffi.call || !ffi.dec_ref || !ffi.move_error || !ffi.dtype_from_string)
    refuse("the bundled libtvm_ffi.so lacks the tvm-ffi C API");
  if (!b.cuda_arch.empty()) {
    // The GPU, through the CUDA runtime the TVM CUDA backend uses (the bridge on CUDA 12 devices).
    void* cudart = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (!cudart) refuse_device("the CUDA runtime libcudart.so.13 is not loaded; the bundle's runtime is incomplete");
    using Count = int (*)(int*);
    using Attr = int (*)(int*, int, int);
    using ErrorString = const char* (*)(int);
    auto count = reinterpret_cast<Count>(dlsym(cudart, "cudaGetDeviceCount"));
    auto attr = reinterpret_cast<Attr>(dlsym(cudart, "cudaDeviceGetAttribute"));
    auto error_string = reinterpret_cast<ErrorString>(dlsym(cudart, "cudaGetErrorString"));
    int n = 0;
    int err = count ? count(&n) : -1;
    if (err != 0 || n < 1)
      refuse_device("this bundle needs a CUDA GPU (" + b.cuda_arch + ") but none is visible" +
             (err != 0 && error_string ? std::string(" (") + error_string(err) + ")" : std::string()));
    int major = 0, minor = 0;
    attr(&major, 75, 0);  // cudaDevAttrComputeCapabilityMajor
    attr(&minor, 76, 0);
    std::string have = "sm_" + std::to_string(major) + std::to_string(minor);
    if (have != b.cuda_arch) refuse_device("this bundle carries code for " + b.cuda_arch + " but the GPU here is " + have);
    rt->dev = DLDevice{kDLCUDA, 0};
  }
  rt->make_shape = Global("ffi.Shape");
  rt->alloc = Global("runtime.TVMTensorAllocWithScope");
  rt->copy_from = Global("runtime.TVMTensorCopyFromBytes");
  rt->copy_to = Global("runtime.TVMTensorCopyToBytes");
  rt->sync = Global("runtime.Device_StreamSync");
  Value load = Global("ffi.ModuleLoadFromFile");
  std::string library = b.dir + "/" + b.library_file;
  Value lib = Call(load.obj(), {Str(library.c_str())}, "loading " + b.library_file);
  Value get_function = Global("ffi.ModuleGetFunction");
  Value loader = Call(get_function.obj(), {Obj(lib), Str("vm_load_executable"), Bool(false)}, "vm_load_executable");
  if (!loader.obj()) refuse(b.library_file + " is not a TVM Relax executable");
  Value vm = Call(loader.obj(), {}, "loading the executable");
  Value init = Call(get_function.obj(), {Obj(vm), Str("vm_initialization"), Bool(false)}, "vm_initialization");
  constexpr int64_t kPooled = 2;
  std::vector<TVMFFIAny> init_args = {Int(rt->dev.device_type), Int(rt->dev.device_id), Int(kPooled)};
  if (rt->dev.device_type != kDLCPU) {
    for (TVMFFIAny a : {Int(kDLCPU), Int(0), Int(kPooled)}) init_args.push_back(a);
  }
  Call(init.obj(), init_args, "initialising the VM");
  rt->main_fn = Call(get_function.obj(), {Obj(vm), Str("main"), Bool(false)}, "main");
  if (!rt->main_fn.obj()) refuse(b.library_file + " has no main function");
  // the library's main takes the inputs and then the weights: a table of another length is refused before
  // any weight is read (run.py and edgeq bench check the same)
  Value arity_fn = Call(get_function.obj(), {Obj(vm), Str("get_function_arity"), Bool(false)}, "get_function_arity");
  if (arity_fn.obj()) {
    Value arity = Call(arity_fn.obj(), {Str("main")}, "reading main's arity");
    size_t listed = b.inputs.size() + b.weights.size();
    if (arity.any.type_index == kTVMFFIInt && arity.any.v_int64 != int64_t(listed))
      refuse("the library's main takes " + std::to_string(arity.any.v_int64) + " arguments but the manifest lists " +
             std::to_string(b.inputs.size()) + " inputs and " + std::to_string(b.weights.size()) +
             " weights; the bundle is damaged or put together from two builds");
  }
  rt->vm = std::move(vm);
  for (const TensorSpec& w : b.weights) {
    std::vector<uint8_t> data = ReadRange(b.dir + "/" + b.weights_file, w.offset, w.bytes, b.weights_file);
    rt->params.push_back(rt->Tensor(w, data.data()));
  }
  return rt;
}

std::vector<Value> DeviceInputs(Runtime* rt, const Bundle& b, const std::map<std::string, HostTensor>& given) {
  for (auto& kv : given) {
    bool known = false;
    for (const TensorSpec& s : b.inputs) known = known || s.name == kv.first;
    if (!known) refuse_usage("unknown input(s): " + kv.first);
  }
  std::vector<Value> out;
  for (const TensorSpec& spec : b.inputs) {
    auto it = given.find(spec.name);
    if (it == given.end()) {
      std::string names;
      for (const TensorSpec& s : b.inputs) names += (names.empty() ? "" : ", ") + s.name;
      refuse_usage("input '" + spec.name + "' is missing; the model's inputs are: " + names);
    }
    const HostTensor& t = it->second;
    if (t.shape != spec.shape || t.dtype.name != spec.dtype.name)
      refuse_usage("input '" + spec.name + "' must be " + spec.dtype.name + " " + ShapeText(spec.shape) + ", got " +
             t.dtype.name + " " + ShapeText(t.shape));
    TensorSpec sized = spec;
    sized.bytes = t.data.size();
    out.push_back(rt->Tensor(sized, t.data.data()));
  }
  return out;
}

// numpy.percentile's default (linear interpolation) on sorted data.
double Percentile(const std::vector<double>& sorted, double q) {
  double pos = q / 100.0 * double(sorted.size() - 1);
  size_t lo = size_t(std::floor(pos)), hi = size_t(std::ceil(pos));
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - double(lo));
}

// ------------------------------------------------------------------------------------------------
// main
// ------------------------------------------------------------------------------------------------
struct Args {
  bool check = false, self_test = false, json = false;
  long benchmark = 0, warmup = 10;
  std::vector<std::string> inputs;
  std::string output, bundle;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr,
               "usage: edgeq-run [--bundle DIR] (--check | --self-test | --input NAME=FILE.npy ... [--output "
               "DIR|FILE.npz] | --benchmark N [--warmup N]) [--json]\nedgeq-run: error: %s\n",
               why.c_str());
  std::exit(2);
}

long ParseCount(const std::string& flag, const char* text, long min) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (errno || !end || *end || v < min || v > 1000000L)
    Usage(flag + " needs a whole number from " + std::to_string(min) + " to 1000000, got '" + text + "'");
  return v;
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int k = 1; k < argc; ++k) {
    std::string arg = argv[k];
    auto value = [&](const std::string& flag) -> const char* {
      if (k + 1 >= argc) Usage(flag + " needs a value");
      return argv[++k];
    };
    if (arg == "--check") a.check = true;
    else if (arg == "--self-test") a.self_test = true;
    else if (arg == "--json") a.json = true;
    else if (arg == "--benchmark") a.benchmark = ParseCount(arg, value(arg), 1);
    else if (arg == "--warmup") a.warmup = ParseCount(arg, value(arg), 0);
    else if (arg == "--input") a.inputs.push_back(value(arg));
    else if (arg == "--output") a.output = value(arg);
    else if (arg == "--bundle") a.bundle = value(arg);
    else if (arg == "-h" || arg == "--help") {
      std::printf("usage: edgeq-run [--bundle DIR] (--check | --self-test | --input NAME=FILE.npy ... [--output "
                  "DIR|FILE.npz] | --benchmark N [--warmup N]) [--json]\n\nRuns the edgeq bundle this file "
                  "belongs to (or --bundle DIR) without Python.\n");
      std::exit(0);
    } else Usage("unknown argument '" + arg + "'");
  }
  if (!(a.check || a.self_test || a.benchmark || !a.inputs.empty()))
    Usage("give --self-test, --benchmark N, --check or --input NAME=FILE.npy");
  return a;
}

std::string BundleDir(const Args& a) {
  if (!a.bundle.empty()) return a.bundle;
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) refuse_usage("cannot find the bundle folder; pass --bundle DIR");
  std::string exe(buf, size_t(n));
  std::string runtime = exe.substr(0, exe.rfind('/'));
  return runtime.substr(0, runtime.rfind('/'));
}

int SelfTest(Runtime* rt, const Bundle& b, bool json) {
  std::map<std::string, HostTensor> inputs;
  std::map<std::string, const TensorSpec*> expected;
  std::string golden_path = b.dir + "/" + b.golden_file;
  for (const TensorSpec& g : b.golden) {
    if (g.name.rfind("input:", 0) == 0) {
      HostTensor t;
      t.name = g.name.substr(6);
      t.dtype = g.dtype;
      t.shape = g.shape;
      t.data = ReadRange(golden_path, g.offset, g.bytes, b.golden_file);
      inputs[t.name] = std::move(t);
    } else if (g.name.rfind("output:", 0) == 0) {
      expected[g.name.substr(7)] = &g;
    }
  }
  std::vector<Value> args = DeviceInputs(rt, b, inputs);
  std::vector<HostTensor> outputs = rt->Run(args, b.outputs);
  bool all_ok = true;
  std::string rows, text;
  for (const HostTensor& got : outputs) {
    auto it = expected.find(got.name);
    if (it == expected.end()) refuse("the golden file has no expected value for output " + got.name);
    const TensorSpec& want_spec = *it->second;
    std::vector<uint8_t> want = ReadRange(golden_path, want_spec.offset, want_spec.bytes, b.golden_file);
    double max_want = 0;
    size_t n = got.Count();
    bool same_shape = got.shape == want_spec.shape;
    for (size_t k = 0; same_shape && k < n; ++k)
      max_want = std::max(max_want, std::fabs(ElementAsDouble(want_spec.dtype, &want[k * size_t(want_spec.dtype.bytes)])));
    double atol = b.atol * std::max(1.0, max_want);
    double diff = same_shape ? 0.0 : INFINITY;
    bool close = same_shape;
    for (size_t k = 0; same_shape && k < n; ++k) {
      double g = ElementAsDouble(got.dtype, &got.data[k * size_t(got.dtype.bytes)]);
      double w = ElementAsDouble(want_spec.dtype, &want[k * size_t(want_spec.dtype.bytes)]);
      double d = std::fabs(g - w);
      if (std::isnan(g) || std::isnan(w)) {
        if (!(std::isnan(g) && std::isnan(w))) close = false;
        diff = NAN;
        continue;
      }
      if (!(d <= atol + b.rtol * std::fabs(w))) close = false;
      if (!std::isnan(diff)) diff = std::max(diff, d);
    }
    all_ok = all_ok && close;
    rows += std::string(rows.empty() ? "" : ", ") + "{\"output\": " + JsonQuote(got.name) + ", \"max_abs_diff\": " +
            JsonNumber(diff) + ", \"rtol\": " + JsonNumber(b.rtol) + ", \"atol\": " + JsonNumber(atol) +
            ", \"ok\": " + (close ? "true" : "false") + "}";
    char line[512];
    std::snprintf(line, sizeof line, "%-4s %s: max |diff| %.3g (rtol %g, atol %.3g)\n", close ? "ok" : "FAIL",
                  got.name.c_str(), diff, b.rtol, atol);
    text += line;
  }
  if (json) std::printf("{\"ok\": %s, \"outputs\": [%s]}\n", all_ok ? "true" : "false", rows.c_str());
  else std::printf("%sself-test %s\n", text.c_str(), all_ok ? "passed" : "FAILED");
  return all_ok ? 0 : 1;
}

void Benchmark(Runtime* rt, const Bundle& b, std::map<std::string, HostTensor> inputs, long runs, long warmup, bool json) {
  if (inputs.empty()) {
    for (const TensorSpec& s : b.inputs) {
      HostTensor t;
      t.name = s.name;
      t.dtype = s.dtype;
      t.shape = s.shape;
      t.data.assign(t.Count() * size_t(s.dtype.bytes), 0);
      inputs[s.name] = std::move(t);
    }
  }
  std::vector<Value> args = DeviceInputs(rt, b, inputs);
  std::vector<TVMFFIAny> call_args;
  for (const Value& v : args) call_args.push_back(Obj(v));
  for (const Value& v : rt->params) call_args.push_back(Obj(v));
  auto once = [&]() {
    Value result;
    if (ffi.call(rt->main_fn.obj(), call_args.data(), int32_t(call_args.size()), &result.any) != 0)
      RaiseFfiError("running the model");
  };
  for (long k = 0; k < warmup; ++k) once();
  rt->Sync();
  std::vector<double> times;
  times.reserve(size_t(runs));
  for (long k = 0; k < runs; ++k) {
    auto start = std::chrono::steady_clock::now();
    once();
    rt->Sync();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  // contract.latency_statistics: percentiles by linear interpolation, throughput = batch / mean latency
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  double mean = 0;
  for (double t : sorted) mean += t;
  mean /= double(sorted.size());
  long batch = b.inputs.empty() || b.inputs[0].shape.empty() ? 1 : long(b.inputs[0].shape[0]);
  auto significant = [](double v) {  // contract.significant: 4 significant digits
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4g", v);
    return std::strtod(buf, nullptr);
  };
  mean = significant(mean);
  double throughput = double(batch) * 1e3 / mean;
  auto ms = [&](double v) { return JsonNumber(significant(v)); };
  double p50 = Percentile(sorted, 50), p90 = Percentile(sorted, 90), p99 = Percentile(sorted, 99);
  if (json) {
    std::string samples;
    for (size_t k = 0; k < times.size(); ++k) samples += (k ? ", " : "") + ms(times[k]);
    std::printf("{\"runs\": %ld, \"batch\": %ld, \"min_ms\": %s, \"mean_ms\": %s, \"p50_ms\": %s, \"p90_ms\": %s, "
                "\"p99_ms\": %s, \"max_ms\": %s, \"throughput_per_s\": %s, \"warmup\": %ld, \"samples_ms\": [%s]}\n",
                runs, batch, ms(sorted.front()).c_str(), ms(mean).c_str(), ms(p50).c_str(), ms(p90).c_str(),
                ms(p99).c_str(), ms(sorted.back()).c_str(), ms(throughput).c_str(),
                warmup, samples.c_str());
  } else {
    std::printf("%ld runs: min %.3f ms  p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  mean %.3f ms  (%.1f inferences/s)\n",
                runs, sorted.front(), p50, p90, p99, mean, throughput);
  }
}

int Main(int argc, char** argv) {
  Args args = ParseArgs(argc, argv);
  std::string dir = BundleDir(args);
  Bundle b = LoadManifest(dir);
  CheckArch(b);
  CheckFiles(b);
  if (!b.cuda_arch.empty()) CheckDriver(b);
  std::map<std::string, HostTensor> inputs;
  for (const std::string& spec : args.inputs) {
    size_t eq = spec.find('=');
    if (eq == std::string::npos || eq == 0) refuse_usage("--input '" + spec + "' is not NAME=FILE.npy");
    HostTensor t = ReadNpy(spec.substr(eq + 1), "--input " + spec);
    t.name = spec.substr(0, eq);
    inputs[t.name] = std::move(t);
  }
  std::unique_ptr<Runtime> rt = LoadRuntime(b);
  if (args.check) {
    if (args.json) std::printf("{\"ok\": true}\n");
    else std::printf("ok: this machine can run %s\n", b.bundle_id.c_str());
    return 0;
  }
  if (args.self_test) {
    int status = SelfTest(rt.get(), b, args.json);
    if (status != 0) return status;
  }
  if (args.benchmark) {
    Benchmark(rt.get(), b, inputs, args.benchmark, args.warmup, args.json);
  } else if (!inputs.empty()) {
    std::vector<Value> device_inputs = DeviceInputs(rt.get(), b, inputs);
    std::vector<HostTensor> outputs = rt->Run(device_inputs, b.outputs);
    if (!args.output.empty()) {
      size_t n = args.output.size();
      if (n > 4 && args.output.compare(n - 4, 4, ".npz") == 0) {
        WriteNpz(args.output, outputs);
      } else {
        std::string dir = args.output;
        while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
        struct stat st;
        if (lstat(dir.c_str(), &st) == 0 && S_ISLNK(st.st_mode))  // the loader often runs as root: no writes through links
          refuse_usage("--output " + args.output + " is a symbolic link; give the folder it points to");
        if (!IsDir(args.output) && mkdir(args.output.c_str(), 0755) != 0)
          refuse_usage("cannot make the output folder " + args.output + ": " + std::strerror(errno));
        for (const HostTensor& t : outputs) WriteFileAtomic(args.output + "/" + SafeFileName(t.name) + ".npy", NpyBytes(t));
      }
    }
    if (args.json) {
      std::string rows;
      for (const HostTensor& t : outputs) {
        std::string dims;
        for (size_t k = 0; k < t.shape.size(); ++k) dims += (k ? ", " : "") + std::to_string(t.shape[k]);
        rows += std::string(rows.empty() ? "" : ", ") + JsonQuote(t.name) + ": {\"shape\": [" + dims +
                "], \"dtype\": " + JsonQuote(t.dtype.name) + "}";
      }
      std::printf("{%s}\n", rows.c_str());
    } else if (args.output.empty()) {
      for (const HostTensor& t : outputs)
        std::printf("%s: %s %s\n", t.name.c_str(), t.dtype.name.c_str(), ShapeText(t.shape).c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const Refused& err) {
    std::fprintf(stderr, "edgeq-run: error: %s\n", err.what());
    return err.status;
  } catch (const std::exception& err) {
    std::fprintf(stderr, "edgeq-run: error: %s\n", err.what());
    return kDevice;
  }
}
