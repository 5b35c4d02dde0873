// utf8.h: UTF-8 as Python reads and writes it (strict decoding, the replacement of invalid bytes)
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit, internal linkage as before the split).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "refuse.h"

namespace {

void AppendUtf8(std::string* out, uint32_t cp) {
  if (cp < 0x80) {
    *out += char(cp);
  } else if (cp < 0x800) {
    *out += char(0xC0 | (cp >> 6));
    *out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += char(0xE0 | (cp >> 12));
    *out += char(0x80 | ((cp >> 6) & 0x3F));
    *out += char(0x80 | (cp & 0x3F));
  } else {
    *out += char(0xF0 | (cp >> 18));
    *out += char(0x80 | ((cp >> 12) & 0x3F));
    *out += char(0x80 | ((cp >> 6) & 0x3F));
    *out += char(0x80 | (cp & 0x3F));
  }
}

// The length of the valid UTF-8 sequence at s[i] (1-4), *cp its code point; or 0 where there is none, and then
// *invalid (where given) the length of the maximal invalid subpart there: the lead byte and the continuation bytes
// valid after it (1-3). Valid as Unicode's table 3-7 (and Python) have it: no overlong forms, no surrogates, nothing
// above U+10FFFF.
size_t Utf8At(const std::string& s, size_t i, uint32_t* cp, size_t* invalid = nullptr) {
  const auto* b = reinterpret_cast<const uint8_t*>(s.data());
  if (invalid) *invalid = 1;
  uint8_t c = b[i];
  if (c < 0x80) { *cp = c; return 1; }
  size_t len;
  uint8_t lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) len = 2;
  else if (c >= 0xE0 && c <= 0xEF) { len = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
  else if (c >= 0xF0 && c <= 0xF4) { len = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
  else return 0;
  uint32_t v = c & (len == 2 ? 0x1F : len == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) return 0;
    uint8_t t = b[i + k];
    if (t < (k == 1 ? lo : 0x80) || t > (k == 1 ? hi : 0xBF)) return 0;
    if (invalid) *invalid = k + 1;
    v = (v << 6) | (t & 0x3F);
  }
  *cp = v;
  return len;
}

// bytes as text, each maximal invalid subpart replaced by U+FFFD: Python's bytes.decode("utf-8", errors="replace")
std::string Utf8Replace(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t invalid = 1;
    size_t len = Utf8At(s, i, &cp, &invalid);
    if (len) {
      out.append(s, i, len);
      i += len;
    } else {
      AppendUtf8(&out, 0xFFFD);
      i += invalid;
    }
  }
  return out;
}

// Text as code points; refuses text that is not UTF-8 (a prompt must be text).
std::vector<uint32_t> CodePoints(const std::string& s, const std::string& what) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t len = Utf8At(s, i, &cp);
    if (!len) refuse_usage(what + " is not UTF-8 text (byte " + std::to_string(i) + ")");
    out.push_back(cp);
    i += len;
  }
  return out;
}

}  // namespace
