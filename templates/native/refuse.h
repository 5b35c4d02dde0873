// refuse.h: how edgeq-run refuses (one line, the contract's exit status)
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit, internal linkage as before the split).
#pragma once

#include <stdexcept>
#include <string>

#include "contract.h"

namespace {

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

}  // namespace
