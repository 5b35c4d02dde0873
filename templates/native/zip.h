// zip.h: a .npz as numpy writes it: a zip of NAME.npy members, stored uncompressed
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit, internal linkage as before the split).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "files.h"
#include "npy.h"

namespace {

uint32_t Crc32(const unsigned char* p, size_t n) {  // zlib's crc32: zip members, PNG chunks (image.h)
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
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t Crc32(const std::string& data) {
  return Crc32(reinterpret_cast<const unsigned char*>(data.data()), data.size());
}

void Put16(std::string* s, uint32_t v) { *s += char(v & 0xFF); *s += char((v >> 8) & 0xFF); }
void Put32(std::string* s, uint32_t v) { Put16(s, v & 0xFFFF); Put16(s, v >> 16); }

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

}  // namespace
