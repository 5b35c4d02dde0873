// edgeq_run_fuzz.cc: fuzz targets for edgeq-run's readers of what a user or a bundle hands it.
//
// Each target feeds one input to the code edgeq-run runs on it, compiled from templates/native/ as the
// loader is (edgeq_run.cc is included whole; its main() is renamed). A refusal (Refused: one line, the
// contract's exit status) is the right answer to bad input; any other exception, a crash, a leak or a
// sanitizer report is a finding.
//
//   json      manifest text through JsonParser
//   manifest  manifest.json in a bundle folder through LoadManifest (every field, preprocess/postprocess checks)
//   npy       an --input .npy through ReadNpy
//   png, jpeg an --input image through DecodeImage (PNG chunks, libpng, libturbojpeg), then ImageTensor
//             (letterbox RGB NCHW and stretch BGR NHWC)
//   yolo      a detector's outputs (head and selected rows, their shapes from the first bytes) through YoloJson,
//             and a classifier's through ClassifyJson
//
// Built two ways (benchmarks/fuzz.sh, tests/test_fuzz_corpus.py):
//   clang++ -fsanitize=fuzzer,address,undefined ...        libFuzzer; EDGEQ_FUZZ_TARGET names the target
//   g++ -DEDGEQ_FUZZ_REPLAY -fsanitize=address,undefined   edgeq-run-fuzz TARGET FILE...: replays a corpus
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unistd.h>

#define main edgeq_run_main
#include "edgeq_run.cc"
#undef main

namespace {

std::string Scratch() {  // one folder per process for the targets that read files
  static std::string dir;
  if (dir.empty()) {
    char tmpl[] = "/tmp/edgeq-fuzz-XXXXXX";
    if (!mkdtemp(tmpl)) std::abort();
    dir = tmpl;
  }
  return dir;
}

std::string WriteScratch(const std::string& name, const std::string& data) {
  std::string path = Scratch() + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (!data.empty() && std::fwrite(data.data(), 1, data.size(), f) != data.size()) std::abort();
  std::fclose(f);
  return path;
}

Preprocess Letterboxed(int64_t side) {
  Preprocess pre;
  pre.given = true;
  pre.input = "x", pre.resize = "letterbox", pre.order = "RGB", pre.layout = "NCHW";
  pre.height = pre.width = side;
  pre.scale = 255;
  pre.mean = {0.0}, pre.std = {1.0};
  return pre;
}

void Image(const std::string& data, const char* name) {
  Pixels p = DecodeImage(WriteScratch(name, data));
  ImageTensor(p, Letterboxed(16));
  Preprocess stretch = Letterboxed(12);
  stretch.resize = "stretch", stretch.order = "BGR", stretch.layout = "NHWC";
  stretch.mean = {0.5, 0.4, 0.3}, stretch.std = {0.2, 0.2, 0.2};
  ImageTensor(p, stretch);
}

// The first 8 bytes choose the shapes (head [1, 4 + classes, anchors], rows [bound, 3]) and how many rows are
// real; the rest fills the two tensors, cycled. A loader holds the head to these shapes before YoloJson.
void Answers(const std::string& data) {
  if (data.size() < 8) return;
  auto byte = [&](size_t k) { return int64_t(uint8_t(data[k])); };
  int64_t classes = 1 + byte(0) % 6, anchors = 1 + byte(1) % 40, bound = 1 + byte(2) % 8;
  int64_t real = byte(3) % (bound + 2) - 1;  // -1 .. bound + 1: what the count output may say
  HostTensor head, rows;
  head.dtype = ParseDType(byte(4) % 2 ? "float32" : "float16");
  head.shape = {1, 4 + classes, anchors};
  rows.dtype = ParseDType("int64");
  rows.shape = {bound, 3};
  head.data.resize(size_t(head.shape[1] * anchors) * size_t(head.dtype.bytes));
  rows.data.resize(size_t(bound * 3) * sizeof(int64_t));
  std::string rest = data.substr(8);
  if (rest.empty()) rest = std::string(1, '\0');
  size_t k = 0;
  for (auto& b : head.data) b = uint8_t(rest[k++ % rest.size()]);
  for (auto& b : rows.data) b = uint8_t(rest[k++ % rest.size()]);
  Postprocess post;
  post.given = true;
  post.kind = "yolo", post.output = "head", post.selected = "rows";
  post.classes = classes, post.max_det = 1 + byte(5) % 10, post.conf = 0.25, post.iou = 0.45;
  post.labels = {"person", "\"quoted\"\n"};
  post.top_k = 0;
  std::string text;
  int64_t clipped = std::max<int64_t>(0, std::min<int64_t>(real, bound));  // as edgeq_run.cc clips the count
  YoloJson(head, rows, clipped, post, Letterboxed(32), byte(6) * 7, byte(7) * 5, &text);
  Postprocess top;
  top.given = true;
  top.kind = "classify", top.output = "head";
  top.top_k = 1 + byte(5) % 5;
  top.softmax = byte(6) % 2;
  top.labels = post.labels;
  ClassifyJson(head, top, &text);
}

void RunOne(const std::string& target, const std::string& data) {
  try {
    if (target == "json") {
      JsonParser(data).Parse();
    } else if (target == "manifest") {
      WriteScratch("manifest.json", data);
      LoadManifest(Scratch());
    } else if (target == "npy") {
      ReadNpy(WriteScratch("input.npy", data), "--input x");
    } else if (target == "png" || target == "jpeg") {
      Image(data, target == "png" ? "input.png" : "input.jpg");
    } else if (target == "yolo") {
      Answers(data);
    } else {
      std::fprintf(stderr, "edgeq-run-fuzz: unknown target '%s' (json, manifest, npy, png, jpeg, yolo)\n", target.c_str());
      std::exit(2);
    }
  } catch (const Refused&) {
    // the answer to bad input: one line and an exit status
  } catch (const std::exception& err) {
    std::fprintf(stderr, "edgeq-run-fuzz: %s: an exception that is not a refusal: %s\n", target.c_str(), err.what());
    std::abort();
  }
}

}  // namespace

#ifdef EDGEQ_FUZZ_REPLAY
int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: edgeq-run-fuzz TARGET FILE...\n");
    return 2;
  }
  setenv("EDGEQ_TRUSTED_KEY", "/nonexistent/edgeq-fuzz.pub", 1);  // manifests are read unsigned, as without a key
  for (int k = 2; k < argc; ++k) {
    std::string data;
    try {
      data = ReadFile(argv[k], size_t(64) << 20, argv[k]);
    } catch (const Refused& err) {
      std::fprintf(stderr, "%s\n", err.what());
      return 2;
    }
    RunOne(argv[1], data);
  }
  std::printf("%s: %d inputs\n", argv[1], argc - 2);
  return 0;
}
#else
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("EDGEQ_TRUSTED_KEY", "/nonexistent/edgeq-fuzz.pub", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* target = std::getenv("EDGEQ_FUZZ_TARGET");
  if (!target) {
    std::fprintf(stderr, "edgeq-run-fuzz: set EDGEQ_FUZZ_TARGET\n");
    std::exit(2);
  }
  RunOne(target, std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
#endif
