// files.h: reading files with a size bound, and writing one atomically without following links
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit, internal linkage as before the split).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "refuse.h"

namespace {

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

}  // namespace
