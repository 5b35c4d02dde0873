// npy.h: tensors on the host: dtypes, float16, .npy in (size bounded before allocation) and out
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit, internal linkage as before the split).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "refuse.h"

namespace {

// ------------------------------------------------------------------------------------------------
// Tensors on the host: dtypes, float16, .npy in and out (.npz out: zip.h)
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

// text from a file, fit for a one-line message: every byte outside printable ASCII as '?' (contract.printable)
std::string Printable(std::string s) {
  for (char& c : s)
    if (uint8_t(c) < 0x20 || uint8_t(c) > 0x7E) c = '?';
  return s;
}

// Reads a .npy file (version 1-3, little-endian, C or Fortran order) with the size bounded before allocation;
// contract.read_npy (run.py) reads it the same way, step by step.
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
    if (start == std::string::npos) fail("malformed .npy header");  // found by benchmarks/fuzz.sh (npy)
    size_t close = header[start] == '(' ? header.find(')', start) : header[start] == '\'' ? header.find('\'', start + 1)
                                                                                          : std::string::npos;
    size_t end = close != std::string::npos ? close + 1 : header.find_first_of(",}", start);
    if ((header[start] == '(' || header[start] == '\'') && close == std::string::npos) fail("malformed .npy header");
    if (end == std::string::npos || end <= start) fail("malformed .npy header");
    return header.substr(start, end - start);
  };
  std::string descr = value_of("descr"), fortran = value_of("fortran_order"), shape = value_of("shape");
  if (fortran != "False" && fortran != "True") fail("malformed .npy header");
  static const std::map<std::string, std::string> names = {
      {"'<f2'", "float16"}, {"'<f4'", "float32"}, {"'<f8'", "float64"}, {"'|i1'", "int8"},  {"'<i2'", "int16"},
      {"'<i4'", "int32"},   {"'<i8'", "int64"},   {"'|u1'", "uint8"},   {"'<u2'", "uint16"}, {"'<u4'", "uint32"},
      {"'<u8'", "uint64"},  {"'|b1'", "bool"}};
  auto it = names.find(descr);
  if (it == names.end()) fail("dtype " + Printable(descr) + " is not one the loaders read (little-endian numbers only)");
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
      if (d > 0 && count > kMaxInputBytes / uint64_t(d))  // checked before multiplying: no overflow
        fail("it declares more than " + std::to_string(kMaxInputBytes) +
             " elements, the most an input may have (EDGEQ_MAX_INPUT_BYTES bounds its bytes)");
      t.shape.push_back(d);
      count *= uint64_t(d);
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
  if (fortran == "True" && t.shape.size() > 1) {  // Fortran order: made C order, as numpy's np.load gives it to run.py
    std::vector<uint8_t> c_order(t.data.size());
    size_t item = size_t(t.dtype.bytes), rank = t.shape.size();
    std::vector<int64_t> index(rank, 0);
    for (size_t i = 0; i < size_t(count); ++i) {
      size_t at = 0, stride = 1;  // the element's place in Fortran order: the first axis varies fastest
      for (size_t k = 0; k < rank; ++k) at += size_t(index[k]) * stride, stride *= size_t(t.shape[k]);
      std::memcpy(&c_order[i * item], &t.data[at * item], item);
      for (size_t k = rank; k-- > 0;) {  // the next index in C order: the last axis varies fastest
        if (++index[k] < t.shape[k]) break;
        index[k] = 0;
      }
    }
    t.data.swap(c_order);
  }
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

}  // namespace
