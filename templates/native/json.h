// json.h: a small JSON reader with bounded nesting (hostile manifests must not exhaust the stack), and quoting
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit, internal linkage as before the split).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "contract.h"
#include "refuse.h"
#include "utf8.h"

namespace {

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
  explicit JsonParser(const std::string& text, std::string what = "manifest.json") : s_(text), what_(std::move(what)) {}
  Json Parse() {
    CheckUtf8();  // the manifest is what the signature covers: every reader must see the same text (Python: strict UTF-8)
    Json v = Value(0);
    Space();
    if (p_ != s_.size()) Fail("trailing data");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& why) {
    refuse(what_ + " is not valid JSON (" + why + " at byte " + std::to_string(p_) + ")");
  }
  // Strict UTF-8 as Python decodes it: no overlong forms, no surrogates, nothing above U+10FFFF.
  void CheckUtf8() {
    uint32_t cp;
    for (size_t i = 0; i < s_.size();) {
      size_t len = Utf8At(s_, i, &cp);
      if (!len) { p_ = i; Fail("not UTF-8 text"); }
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
      std::unordered_set<std::string> keys;
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
        // first-wins and last-wins readers would see different documents (a set: a tokenizer's vocabulary has
        // tens of thousands of keys)
        if (!keys.insert(key).second) { p_ = key_at; Fail("duplicate key \"" + key + "\""); }
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
          AppendUtf8(&out, cp);
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
  const std::string& s_;
  std::string what_;
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

}  // namespace
