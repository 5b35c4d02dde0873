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
#include <condition_variable>
#include <csignal>
#include <deque>
#include <mutex>
#include <thread>
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

#include "base64.h"
#include "contract.h"  // generated from contract.py at build time (edgeq.runtime.assemble.contract_header)
#include "files.h"
#include "image.h"
#include "json.h"
#include "npy.h"
#include "refuse.h"
#include "schema.h"
#include "sha256.h"
#include "tokenizer.h"
#include "video.h"
#include "zip.h"

namespace {

std::string SafeFileName(const std::string& name) {
  std::string out;
  for (char c : name) out += (std::isalnum(uint8_t(c)) || c == '.' || c == '_' || c == '-') ? c : '_';
  if (out.empty() || out[0] == '.') out = "_" + out;
  return out;
}

// ------------------------------------------------------------------------------------------------
// Signature: ed25519 over manifest.json, verified with the system's OpenSSL (libcrypto) when a key is trusted
// ------------------------------------------------------------------------------------------------

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
  // padded rows (NonMaxSuppression's selection): the output named rows_count says how many rows are real
  int64_t rows_axis = -1, rows_bound = 0;
  std::string rows_count;
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
    const Json* rows = item.Find("rows");
    if (rows && rows->kind != Json::kNull) {
      if (rows->kind != Json::kObject) refuse("manifest field '" + where + ".rows' is not an object");
      s.rows_axis = rows->At("axis", where + ".rows.").Int(where + ".rows.axis");
      s.rows_bound = rows->At("bound", where + ".rows.").Int(where + ".rows.bound");
      s.rows_count = rows->At("count", where + ".rows.").Str(where + ".rows.count");
      rows->At("source", where + ".rows.").Str(where + ".rows.source");
      if (s.rows_axis < 0 || s.rows_bound < 0) refuse("manifest field '" + where + ".rows' has a negative axis or bound");
    }
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
  double rtol = 0, atol = 0, outliers = 0;  // golden.outliers: 0 where absent
  std::vector<TensorSpec> inputs, outputs, weights, golden;
  std::string weights_file, golden_file, library_file;
  std::vector<std::string> libraries;  // runtime libraries in load order, relative to dir
  std::string bridge;                  // runtime/libcudart.so.13 when the bundle carries the CUDA 12 bridge
  Preprocess preprocess;               // --input IMAGE (image.h)
  Postprocess postprocess;             // --postprocess classify (image.h)
  struct Step {
    std::string function, kind;
    int64_t prompt = 0, capacity = 0;
    std::vector<std::string> inputs;
  };
  struct Generate {  // a language model (contract.GenerateRecord); given: the manifest has one
    bool given = false;
    int64_t context = 0, vocab = 0, self_test_tokens = 0;
    std::vector<Step> steps;
    DType ids_dtype, mask_dtype;
    std::string tokenizer;  // "" where the bundle has none
    bool chat = false;
    std::string chat_prefix, chat_suffix;
    std::vector<int64_t> stop;
  } generate;
};

Bundle LoadManifest(const std::string& dir) {
  Bundle b;
  b.dir = dir;
  b.manifest_bytes = ReadFile(dir + "/manifest.json", kMaxManifestBytes, "manifest.json");
  CheckSignature(dir, b.manifest_bytes);
  b.manifest = JsonParser(b.manifest_bytes).Parse();
  const Json& m = b.manifest;
  if (m.kind != Json::kObject) refuse("manifest.json is not a JSON object");
  CheckManifestSchema(m);  // every field's kind, as run.py's contract.Manifest.from_json checks them (schema.h)
  CheckManifestFiles(m);   // and the file list, as safebundle.check_manifest does next
  if (const Json* generate = m.Find("generate"); generate && generate->kind != Json::kNull) {
    Bundle::Generate& g = b.generate;
    g.given = true;
    g.context = generate->At("context", "generate.").Int("generate.context");
    g.vocab = generate->At("vocab", "generate.").Int("generate.vocab");
    g.self_test_tokens = generate->At("self_test_tokens", "generate.").Int("generate.self_test_tokens");
    g.ids_dtype = ParseDType(generate->At("ids_dtype", "generate.").Str("generate.ids_dtype"));
    g.mask_dtype = ParseDType(generate->At("mask_dtype", "generate.").Str("generate.mask_dtype"));
    for (const Json& step : generate->At("steps", "generate.").Arr("generate.steps")) {
      Bundle::Step st;
      st.function = step.At("function", "generate.steps.").Str("generate.steps.function");
      st.kind = step.At("kind", "generate.steps.").Str("generate.steps.kind");
      st.prompt = step.At("prompt", "generate.steps.").Int("generate.steps.prompt");
      st.capacity = step.At("capacity", "generate.steps.").Int("generate.steps.capacity");
      for (const Json& name : step.At("inputs", "generate.steps.").Arr("generate.steps.inputs"))
        st.inputs.push_back(name.Str("generate.steps.inputs"));
      g.steps.push_back(std::move(st));
    }
    if (const Json* t = generate->Find("tokenizer"); t && t->kind == Json::kString) {
      if (!m.At("files", "").Find(t->str)) refuse("manifest generate.tokenizer is not one of the bundle's files");
      g.tokenizer = t->str;
    }
    const Json* prefix = generate->Find("chat_prefix");
    const Json* suffix = generate->Find("chat_suffix");
    if (prefix && prefix->kind == Json::kString && suffix && suffix->kind == Json::kString) {
      g.chat = true;
      g.chat_prefix = prefix->str;
      g.chat_suffix = suffix->str;
    }
    for (const Json& id : generate->At("stop", "generate.").Arr("generate.stop")) g.stop.push_back(id.Int("generate.stop"));
  }
  b.bundle_id = m.At("bundle_id", "").Str("bundle_id");
  const Json& device = m.At("device", "");
  b.arch = device.At("arch", "device.").Str("device.arch");
  b.profile = device.At("profile", "device.").Str("device.profile");
  const Json* cuda = device.Find("cuda_arch");
  if (cuda && cuda->kind == Json::kString) {
    b.cuda_arch = cuda->str;
    const Json* toolkit = m.At("toolchain", "").Find("cuda_toolkit");  // Manifest.cuda_major: none without a toolkit
    if (toolkit && toolkit->kind == Json::kObject) b.cuda_major = std::atoi(toolkit->Find("version")->str.c_str());
  }
  b.inputs = ParseSpecs(m.At("inputs", ""), "inputs", false);
  b.outputs = ParseSpecs(m.At("outputs", ""), "outputs", false);
  for (size_t k = 0; k < b.outputs.size(); ++k) {  // contract.rows_problem, in the same order
    const TensorSpec& spec = b.outputs[k];
    if (spec.rows_axis < 0) continue;
    std::string where = "manifest field 'outputs[" + std::to_string(k) + "].rows";
    if (size_t(spec.rows_axis) >= spec.shape.size() || spec.shape[size_t(spec.rows_axis)] != spec.rows_bound)
      refuse(where + "' does not fit the output's shape");
    const TensorSpec* count = nullptr;
    for (const TensorSpec& other : b.outputs)
      if (other.name == spec.rows_count) { count = &other; break; }
    if (!count || count == &spec || count->dtype.name != "int64" || count->shape != std::vector<int64_t>{1})
      refuse(where + ".count' does not name an int64 output of shape [1]");
  }
  b.preprocess = ParsePreprocess(m);
  b.postprocess = ParsePostprocess(m);
  std::string problem = ProcessProblem(b.preprocess, b.postprocess, b.inputs, b.outputs);  // contract.process_problem
  if (!problem.empty()) refuse(problem);
  const Json& weights = m.At("weights", "");
  const Json& golden = m.At("golden", "");
  for (const Json* section : {&weights, &golden}) {
    const Json* format = section->Find("format");
    if (!format || format->kind != Json::kString || format->str != "edgeq-raw-1")
      refuse("this bundle's tensors are not in the edgeq-raw-1 form the loaders read; package it again");
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
  if (const Json* outliers = golden.Find("outliers"); outliers && outliers->kind != Json::kNull) {
    b.outliers = outliers->Num("golden.outliers");
    if (!(b.outliers >= 0 && b.outliers <= kMaxGoldenOutliers))
      refuse("manifest golden.outliers must be from 0 to " + JsonNumber(kMaxGoldenOutliers));
  }
  b.library_file = m.At("library", "").At("file", "library.").Str("library.file");
  const Json* runtime = m.Find("runtime");
  if (!runtime || runtime->kind != Json::kObject) refuse_device("this bundle carries no runtime (packaged with --runtime none)");
  for (const Json& lib : runtime->At("libraries", "runtime.").Arr("runtime.libraries"))
    b.libraries.push_back(lib.Str("runtime.libraries"));
  const Json* bridge = runtime->Find("cuda_bridge");
  if (bridge && bridge->kind == Json::kObject) {  // safebundle.check_manifest: one of the bundle's files
    const Json* file = bridge->Find("file");
    if (!file || file->kind != Json::kString || !m.At("files", "").Find(file->str))
      refuse("manifest runtime.cuda_bridge.file is not one of the bundle's files");
    b.bridge = file->str;
  }
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
  decltype(&TVMFFIObjectIncRef) inc_ref = nullptr;
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

// a DLPack type as numpy names it (what contract.py's dtype names are)
std::string DTypeText(DLDataType t) {
  const char* kind = t.code == kDLInt ? "int" : t.code == kDLUInt ? (t.bits == 1 ? "bool" : "uint")
                     : t.code == kDLFloat ? "float" : t.code == kDLBfloat ? "bfloat" : "type";
  std::string text = std::string(kind) + (t.bits == 1 && t.code == kDLUInt ? "" : std::to_string(t.bits));
  return t.lanes == 1 ? text : text + "x" + std::to_string(t.lanes);
}

// contract.output_problem: an output the library returns other than the manifest declares it
std::string OutputProblem(const std::string& name, const std::string& dtype, const std::string& shape,
                          const std::string& want_dtype, const std::string& want_shape) {
  return "the library returns output '" + name + "' as " + dtype + " " + shape + ", the manifest declares " +
         want_dtype + " " + want_shape + "; the bundle is damaged or put together from two builds";
}

struct Runtime {
  DLDevice dev{kDLCPU, 0};
  Value vm, main_fn, make_shape, alloc, copy_from, copy_to, sync, get_function;
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
      // what the library returned must be what the manifest says, before a byte is read by the manifest's sizes
      DLDataType want;
      TVMFFIByteArray name{specs[k].dtype.name.data(), specs[k].dtype.name.size()};
      if (ffi.dtype_from_string(&name, &want) != 0 || want.code != t->dtype.code || want.bits != t->dtype.bits ||
          want.lanes != t->dtype.lanes || t->dtype.bits * t->dtype.lanes != specs[k].dtype.bytes * 8 ||
          h.shape != specs[k].shape)
        refuse(OutputProblem(specs[k].name, DTypeText(t->dtype), ShapeText(h.shape), specs[k].dtype.name,
                             ShapeText(specs[k].shape)));
      h.data.resize(h.Count() * size_t(specs[k].dtype.bytes));
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
// reserve_cpu: a pipelined video run's decoding and preprocessing thread gets a core of its own (CPU bundles).
std::unique_ptr<Runtime> LoadRuntime(const Bundle& b, bool reserve_cpu = false) {
  std::unique_ptr<Runtime> rt(new Runtime());
  // TVM's thread pool assumes two hardware threads per core and uses half the CPUs unless told; inference
  // gets every CPU this process may run on (TVM_NUM_THREADS still decides where set), as in run.py.
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof cpus, &cpus) == 0) {
    int n = CPU_COUNT(&cpus);
    if (reserve_cpu && b.cuda_arch.empty() && n > 1) --n;
    setenv("TVM_NUM_THREADS", std::to_string(n).c_str(), 0);
  }
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
  ffi.inc_ref = reinterpret_cast<decltype(ffi.inc_ref)>(dlsym(ffi_lib, "TVMFFIObjectIncRef"));
  ffi.move_error = reinterpret_cast<decltype(ffi.move_error)>(dlsym(ffi_lib, "TVMFFIErrorMoveFromRaised"));
  ffi.dtype_from_string = reinterpret_cast<decltype(ffi.dtype_from_string)>(dlsym(ffi_lib, "TVMFFIDataTypeFromString"));
  if (!ffi.get_global || !ffi.call || !ffi.dec_ref || !ffi.inc_ref || !ffi.move_error || !ffi.dtype_from_string)
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
  rt->get_function = std::move(get_function);
  if (b.generate.given) {  // a language model's steps (LanguageModel) take the weights after their inputs
    rt->vm = std::move(vm);
    for (const TensorSpec& w : b.weights) {
      std::vector<uint8_t> data = ReadRange(b.dir + "/" + b.weights_file, w.offset, w.bytes, b.weights_file);
      rt->params.push_back(rt->Tensor(w, data.data()));
    }
    return rt;
  }
  rt->main_fn = Call(rt->get_function.obj(), {Obj(vm), Str("main"), Bool(false)}, "main");
  if (!rt->main_fn.obj()) refuse(b.library_file + " has no main function");
  // the library's main takes the inputs and then the weights: a table of another length is refused before
  // any weight is read (run.py and edgeq bench check the same)
  Value arity_fn = Call(rt->get_function.obj(), {Obj(vm), Str("get_function_arity"), Bool(false)}, "get_function_arity");
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


// run.py's answer(): the real rows of padded outputs, and classify's top or yolo's detections (json and text)
struct Answered {
  std::vector<int64_t> real;
  const char* key = "top";
  std::string json, text;
  std::vector<Detection> drawn;
};

Answered AnswerOf(const Bundle& b, const std::vector<HostTensor>& outputs, int64_t image_h, int64_t image_w) {
  Answered a;
  a.real.assign(outputs.size(), -1);  // padded outputs: their real rows, from the count output
  std::vector<int64_t>& real = a.real;
  for (size_t k = 0; k < outputs.size() && k < b.outputs.size(); ++k) {
    const TensorSpec& spec = b.outputs[k];
    if (spec.rows_axis < 0) continue;
    for (const HostTensor& t : outputs)
      if (t.name == spec.rows_count && t.data.size() >= sizeof(int64_t)) {
        int64_t n;
        std::memcpy(&n, t.data.data(), sizeof n);
        real[k] = std::max<int64_t>(0, std::min<int64_t>(n, spec.rows_bound));
      }
  }
  a.key = b.postprocess.kind == "yolo" ? "detections" : "top";
  if (b.postprocess.given && b.postprocess.kind == "classify") {
    for (size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i].name == b.postprocess.output) a.json = ClassifyJson(outputs[i], b.postprocess, &a.text);
  } else if (b.postprocess.given) {
    const HostTensor *head = nullptr, *rows = nullptr;
    int64_t rows_real = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].name == b.postprocess.output) head = &outputs[i];
      if (outputs[i].name == b.postprocess.selected) rows = &outputs[i], rows_real = std::max<int64_t>(0, real[i]);
    }
    if (head && rows)
      a.json = YoloJson(*head, *rows, rows_real, b.postprocess, b.preprocess, image_h, image_w, &a.text, &a.drawn);
  }
  return a;
}


// ------------------------------------------------------------------------------------------------
// main
// ------------------------------------------------------------------------------------------------
struct Args {
  bool check = false, self_test = false, json = false, no_pipeline = false;
  long benchmark = 0, warmup = 10;
  double timeout = 10.0;  // video.DEFAULT_TIMEOUT_S
  std::vector<std::string> inputs;
  std::string output, bundle;
  // language models (run.py's flags and bounds)
  bool has_prompt = false, has_prompt_ids = false, has_tokenize = false, chat = false, ignore_eos = false;
  std::string prompt, tokenize;
  std::vector<int64_t> prompt_ids;
  long max_tokens = 128;
  double temperature = 0.0, top_p = 1.0;
  uint64_t seed = 0;
};

[[noreturn]] void Usage(const std::string& why) {
  std::fprintf(stderr,
               "usage: edgeq-run [--bundle DIR] (--check | --self-test | --input NAME=FILE.npy ... [--output "
               "DIR|FILE.npz] | --input VIDEO [--output DIR] [--timeout S] [--no-pipeline] | --benchmark N [--warmup N] | "
               "--prompt TEXT|--prompt-ids ID,... [--chat] [--max-tokens N] [--temperature T] [--top-p P] [--seed S] "
               "[--ignore-eos] | --tokenize TEXT) [--json]\nedgeq-run: error: %s\n",
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
    else if (arg == "--no-pipeline") a.no_pipeline = true;
    else if (arg == "--timeout") {
      const char* text = value(arg);
      char* end = nullptr;
      double v = std::strtod(text, &end);
      if (!end || *end || !(v > 0 && v <= 3600)) Usage(std::string("--timeout needs seconds from 0 to 3600, got '") + text + "'");
      a.timeout = v;
    }
    else if (arg == "--bundle") a.bundle = value(arg);
    else if (arg == "--prompt") a.prompt = value(arg), a.has_prompt = true;
    else if (arg == "--tokenize") a.tokenize = value(arg), a.has_tokenize = true;
    else if (arg == "--chat") a.chat = true;
    else if (arg == "--ignore-eos") a.ignore_eos = true;
    else if (arg == "--max-tokens") {
      const char* text = value(arg);
      char* end = nullptr;
      errno = 0;
      long v = std::strtol(text, &end, 10);
      if (errno || !end || *end || end == text) Usage(std::string("argument --max-tokens: invalid int value: '") + text + "'");
      if (v < 1 || v > 1000000) Usage("--max-tokens needs N from 1 to 1000000");
      a.max_tokens = v;
    } else if (arg == "--temperature" || arg == "--top-p") {
      const char* text = value(arg);
      char* end = nullptr;
      double v = std::strtod(text, &end);
      if (!end || *end || end == text) Usage("argument " + arg + ": invalid float value: '" + text + "'");
      if (arg == "--temperature") {
        if (!(v >= 0 && v <= 100)) Usage("--temperature needs T from 0 to 100");
        a.temperature = v;
      } else {
        if (!(v > 0 && v <= 1)) Usage("--top-p needs P above 0 and at most 1");
        a.top_p = v;
      }
    } else if (arg == "--seed") {
      const char* text = value(arg);
      char* end = nullptr;
      errno = 0;
      unsigned long long v = std::strtoull(text, &end, 10);
      if (errno || !end || *end || end == text || text[0] == '-')
        Usage("--seed needs S from 0 to 18446744073709551615");
      a.seed = uint64_t(v);
    } else if (arg == "--prompt-ids") {
      std::string text = value(arg);
      a.has_prompt_ids = true;
      size_t start = 0;
      while (start <= text.size()) {
        size_t comma = text.find(',', start);
        std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
        if (b != std::string::npos) {
          item = item.substr(b, e - b + 1);
          char* end = nullptr;
          errno = 0;
          long long v = std::strtoll(item.c_str(), &end, 10);
          if (errno || !end || *end) Usage("--prompt-ids needs token ids separated by commas, e.g. 1,504,3458");
          a.prompt_ids.push_back(v);
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      if (a.prompt_ids.empty() || *std::min_element(a.prompt_ids.begin(), a.prompt_ids.end()) < 0)
        Usage("--prompt-ids needs at least one token id, none negative");
    }
    else if (arg == "-h" || arg == "--help") {
      std::printf("usage: edgeq-run [--bundle DIR] (--check | --self-test | --input NAME=FILE.npy ... [--output "
                  "DIR|FILE.npz] | --input VIDEO [--output DIR] [--timeout S] [--no-pipeline] | --benchmark N [--warmup N] "
                  "| --prompt TEXT|--prompt-ids ID,... [--chat] [--max-tokens N] [--temperature T] [--top-p P] [--seed S] "
                  "[--ignore-eos] | --tokenize TEXT) [--json]\n\nRuns the edgeq bundle this file belongs to (or --bundle DIR) without "
                  "Python. VIDEO: a file (.mp4, .mkv, .avi), /dev/videoN, csi://N, rtsp://... or gst:PIPELINE ending in "
                  "appsink. A language model streams the tokens it generates after --prompt (greedy at temperature 0, "
                  "the default; --chat wraps the prompt in the model's chat template).\n");
      std::exit(0);
    } else Usage("unknown argument '" + arg + "'");
  }
  if (a.has_prompt && a.has_prompt_ids) Usage("give --prompt or --prompt-ids, not both");
  if (!(a.check || a.self_test || a.benchmark || !a.inputs.empty() || a.has_prompt || a.has_prompt_ids || a.has_tokenize))
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

double Significant4(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return std::strtod(buf, nullptr);
}

// run.py's golden_problem: every input and output has its golden entry, the inputs' as the model takes them
std::string GoldenProblem(const Bundle& b) {
  for (const auto* specs : {&b.inputs, &b.outputs})
    for (const TensorSpec& spec : *specs) {
      std::string key = (specs == &b.inputs ? "input:" : "output:") + spec.name;
      const TensorSpec* entry = nullptr;
      for (const TensorSpec& g : b.golden)
        if (g.name == key) { entry = &g; break; }
      if (!entry) return "the golden file has no " + key + "; package the bundle again";
      if (specs == &b.inputs && (entry->shape != spec.shape || entry->dtype.name != spec.dtype.name))
        return "the golden file's " + key + " is " + entry->dtype.name + " " + ShapeText(entry->shape) + ", not " +
               spec.dtype.name + " " + ShapeText(spec.shape) + " as the model takes it";
    }
  return "";
}

int SelfTest(Runtime* rt, const Bundle& b, bool json) {
  if (std::string problem = GoldenProblem(b); !problem.empty()) refuse(problem);
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
    double max_want = 0;  // run.py: np.max(np.abs(want)), whatever the shapes
    size_t n = got.Count(), want_n = want.size() / size_t(want_spec.dtype.bytes);
    bool same_shape = got.shape == want_spec.shape;
    for (size_t k = 0; k < want_n; ++k)
      max_want = std::max(max_want, std::fabs(ElementAsDouble(want_spec.dtype, &want[k * size_t(want_spec.dtype.bytes)])));
    if (want_n == 0) max_want = 1.0;  // run.py: an empty output is judged at atol
    double atol = b.atol * std::max(1.0, max_want);
    double diff = same_shape ? 0.0 : INFINITY;
    size_t outside = 0;  // values outside the tolerance (numpy's isclose, NaN equal to NaN)
    for (size_t k = 0; same_shape && k < n; ++k) {
      double g = ElementAsDouble(got.dtype, &got.data[k * size_t(got.dtype.bytes)]);
      double w = ElementAsDouble(want_spec.dtype, &want[k * size_t(want_spec.dtype.bytes)]);
      double d = std::fabs(g - w);
      if (std::isnan(g) || std::isnan(w)) {
        if (!(std::isnan(g) && std::isnan(w))) ++outside;
        diff = NAN;
        continue;
      }
      if (!(g == w || d <= atol + b.rtol * std::fabs(w))) ++outside;
      if (!std::isnan(diff)) diff = std::max(diff, d);
    }
    size_t allowed = size_t(std::floor(b.outliers * double(want_n)));  // GoldenRecord.allowed_outside(want.size)
    diff = Significant4(diff), atol = Significant4(atol);  // run.py's report: float("%.4g" % x)
    bool close = same_shape && outside <= allowed;
    all_ok = all_ok && close;
    rows += std::string(rows.empty() ? "" : ", ") + "{\"output\": " + JsonQuote(got.name) + ", \"max_abs_diff\": " +
            JsonNumber(diff) + ", \"rtol\": " + JsonNumber(b.rtol) + ", \"atol\": " + JsonNumber(atol) +
            ", \"ok\": " + (close ? "true" : "false") +
            (b.outliers > 0 ? ", \"outside\": " + std::to_string(outside) + ", \"allowed\": " + std::to_string(allowed)
                            : std::string()) + "}";
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
    // the values of contract.latency_statistics, in the order of its keys (kLatencyKeys, generated from it)
    const std::string values[] = {std::to_string(runs), std::to_string(batch), ms(sorted.front()), ms(mean), ms(p50),
                                  ms(p90), ms(p99), ms(sorted.back()), ms(throughput)};
    static_assert(sizeof(values) / sizeof(values[0]) == kLatencyKeyCount,
                  "contract.latency_statistics changed: give edgeq-run's --benchmark --json its new fields");
    std::string line;
    for (size_t k = 0; k < kLatencyKeyCount; ++k) line += JsonQuote(kLatencyKeys[k]) + ": " + values[k] + ", ";
    std::printf("{%s\"warmup\": %ld, \"samples_ms\": [%s]}\n", line.c_str(), warmup, samples.c_str());
  } else {
    std::printf("%ld runs: min %.3f ms  p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  mean %.3f ms  (%.1f inferences/s)\n",
                runs, sorted.front(), p50, p90, p99, mean, throughput);
  }
}

// ------------------------------------------------------------------------------------------------
// video: run.py's run_stream, the same frames, answers, queue and summary
// ------------------------------------------------------------------------------------------------
volatile std::sig_atomic_t g_interrupted = 0;
void OnInterrupt(int) { g_interrupted = 1; }

constexpr size_t kQueueFrames = 4;  // run.py's QUEUE_FRAMES

struct Frame {
  int64_t index;
  double seconds;  // < 0: the buffer had no timestamp
  Pixels pixels;
  HostTensor tensor;
};

std::string Rounded(double v, int digits) {  // Python's round(v, digits), as JSON
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return JsonNumber(std::strtod(buf, nullptr));
}

// run.py's output_folder: the --output folder, made if missing, never a symbolic link (the loader often runs as
// root: no writes through links)
std::string OutputFolder(const std::string& output) {
  std::string dir = output;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  struct stat st;
  if (lstat(dir.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
    refuse_usage("--output " + output + " is a symbolic link; give the folder it points to");
  if (!IsDir(dir) && mkdir(dir.c_str(), 0755) != 0)
    refuse_usage("cannot make the output folder " + output + ": " + std::strerror(errno));
  return dir;
}

std::string FrameFolder(const std::string& output) {
  if (output.empty()) return "";
  if (EndsWith(output, ".npz") || EndsWith(output, ".npy"))
    refuse_usage("--output " + output + ": a video's answers are drawn on its frames: give a video file (.avi, .m4v, "
                 ".mkv, .mov, .mp4) or a folder for PNG frames (DIR/)");
  return OutputFolder(output);
}

int RunStream(Runtime* rt, const Bundle& b, const std::string& spec, const Args& args) {
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  if (!b.preprocess.given)
    refuse_usage("--input " + spec + " is a video, and this bundle was packaged without --preprocess: package it with "
                 "--preprocess");
  bool to_video = !args.output.empty() && VideoMuxer(VideoSuffix(args.output)) != nullptr;
  std::string folder = to_video ? "" : FrameFolder(args.output);
  Clock::time_point start = Clock::now();
  VideoSource source(spec, args.timeout);
  std::unique_ptr<VideoWriter> writer(to_video ? new VideoWriter(args.output) : nullptr);
  std::map<std::string, std::vector<double>> times;  // stage -> seconds per frame
  std::mutex mu;
  std::condition_variable cond;
  std::deque<Frame> queue;
  bool done = false, stop = false;
  int64_t dropped = 0, answered = 0;
  std::string error;
  auto add_time = [&](const char* stage, double v) {
    std::lock_guard<std::mutex> lock(mu);
    times[stage].push_back(v);
  };
  auto next_frame = [&](int64_t index, Frame* f) {
    Clock::time_point t0 = Clock::now();
    if (!source.Read(&f->pixels, &f->seconds)) return false;
    double decode = seconds_since(t0);
    Clock::time_point t1 = Clock::now();
    f->index = index;
    f->tensor = ImageTensor(f->pixels, b.preprocess);
    add_time("decode", decode);
    add_time("preprocess", seconds_since(t1));
    return true;
  };
  auto answer_frame = [&](const Frame& f) {
    Clock::time_point t0 = Clock::now();
    std::map<std::string, HostTensor> given;
    given[b.preprocess.input] = f.tensor;
    std::vector<HostTensor> outputs = rt->Run(DeviceInputs(rt, b, given), b.outputs);
    Clock::time_point t1 = Clock::now();
    Answered a = AnswerOf(b, outputs, f.pixels.h, f.pixels.w);
    if (!folder.empty() || writer) {
      Pixels drawn = b.postprocess.kind == "yolo" ? DrawDetections(f.pixels, a.drawn) : f.pixels;
      if (writer) {
        try {
          writer->Write(drawn, f.seconds, source.rate_num(), source.rate_den());
        } catch (const VideoFailed& err) {
          refuse_usage(err.what());
        }
      } else {
        char name[64];
        std::snprintf(name, sizeof name, "/frame_%06lld.png", static_cast<long long>(f.index));
        WriteFileAtomic(folder + name, PngBytes(drawn));
      }
    }
    add_time("postprocess", seconds_since(t1));
    add_time("infer", std::chrono::duration<double>(t1 - t0).count());
    ++answered;
    std::string when = f.seconds < 0 ? "null" : Rounded(f.seconds, 6);
    if (args.json) {
      std::string row = "{\"frame\": " + std::to_string(f.index) + ", \"time\": " + when;
      if (b.postprocess.given) {
        row += std::string(", \"") + a.key + "\": " + a.json;
      } else {
        std::string rows;
        for (const HostTensor& t : outputs) {
          std::string dims;
          for (size_t k = 0; k < t.shape.size(); ++k) dims += (k ? ", " : "") + std::to_string(t.shape[k]);
          rows += std::string(rows.empty() ? "" : ", ") + JsonQuote(t.name) + ": {\"shape\": [" + dims +
                  "], \"dtype\": " + JsonQuote(t.dtype.name) + "}";
        }
        row += ", \"outputs\": {" + rows + "}";
      }
      std::printf("%s}\n", row.c_str());
    } else {
      char head[96];
      if (f.seconds < 0) std::snprintf(head, sizeof head, "frame %lld", static_cast<long long>(f.index));
      else std::snprintf(head, sizeof head, "frame %lld at %.3f s", static_cast<long long>(f.index), f.seconds);
      std::printf("%s\n", head);
      std::string text = b.postprocess.given ? a.text : "";
      for (size_t at = 0; !text.empty() && at <= text.size();) {
        size_t nl = text.find('\n', at);
        std::printf("  %s\n", text.substr(at, nl == std::string::npos ? std::string::npos : nl - at).c_str());
        if (nl == std::string::npos) break;
        at = nl + 1;
      }
    }
    std::fflush(stdout);
  };

  std::signal(SIGINT, OnInterrupt);
  std::thread worker;
  if (args.no_pipeline) {
    try {
      for (int64_t index = 0; !g_interrupted; ++index) {
        Frame f;
        if (!next_frame(index, &f)) break;
        answer_frame(f);
      }
    } catch (const VideoFailed& err) {
      error = err.what();
    }
  } else {
    worker = std::thread([&] {
      try {
        for (int64_t index = 0;; ++index) {
          {
            std::lock_guard<std::mutex> lock(mu);
            if (stop) break;
          }
          Frame f;
          if (!next_frame(index, &f)) break;
          std::unique_lock<std::mutex> lock(mu);
          cond.wait(lock, [&] { return queue.size() < kQueueFrames || source.live() || stop; });
          if (queue.size() >= kQueueFrames) {  // live: the oldest frame goes
            queue.pop_front();
            ++dropped;
          }
          queue.push_back(std::move(f));
          cond.notify_all();
        }
      } catch (const VideoFailed& err) {
        std::lock_guard<std::mutex> lock(mu);
        error = err.what();
      } catch (const std::exception& err) {
        std::lock_guard<std::mutex> lock(mu);
        error = err.what();
      }
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      cond.notify_all();
    });
    try {
      while (!g_interrupted) {
        Frame f;
        {
          std::unique_lock<std::mutex> lock(mu);
          while (queue.empty() && !done && !g_interrupted) cond.wait_for(lock, std::chrono::milliseconds(100));
          if (queue.empty()) break;
          f = std::move(queue.front());
          queue.pop_front();
          cond.notify_all();
        }
        answer_frame(f);
      }
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu);
        stop = true;
        cond.notify_all();
      }
      source.cancel = true;
      worker.join();
      throw;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
      cond.notify_all();
    }
    source.cancel = true;
    worker.join();
  }
  double seconds = seconds_since(start);
  source.Close();
  if (writer) {  // the frames answered, also where the source stopped or Ctrl-C came (a refusal discards it)
    try {
      writer->Close();
    } catch (const VideoFailed& err) {
      refuse_usage(err.what());
    }
  }
  bool interrupted = g_interrupted != 0;
  // the summary (video.describe_summary / run.py's JSON)
  std::string stages_json, stages_text;
  static const char* const kStages[] = {"decode", "preprocess", "infer", "postprocess"};  // video.StageTimes.STAGES
  for (const char* stage : kStages) {
    std::vector<double>& v = times[stage];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    double p50 = Percentile(v, 50) * 1e3, p99 = Percentile(v, 99) * 1e3;
    stages_json += std::string(stages_json.empty() ? "" : ", ") + "\"" + stage + "\": {\"p50_ms\": " + Rounded(p50, 3) +
                   ", \"p99_ms\": " + Rounded(p99, 3) + "}";
    char line[128];
    std::snprintf(line, sizeof line, "\n  %-12s p50 %8.3f ms  p99 %8.3f ms", stage, p50, p99);
    stages_text += line;
  }
  double fps = seconds > 0 ? double(answered) / seconds : 0.0;
  std::string stopped = interrupted ? "interrupted" : error;
  if (args.json) {
    std::printf("{\"summary\": {\"source\": %s, \"live\": %s, \"pipelined\": %s, \"frames\": %lld, \"seconds\": %s, "
                "\"fps\": %s, \"dropped\": %lld, \"stages\": {%s}%s}}\n",
                JsonQuote(source.name()).c_str(), source.live() ? "true" : "false", args.no_pipeline ? "false" : "true",
                static_cast<long long>(answered), Rounded(seconds, 3).c_str(), Rounded(fps, 2).c_str(),
                static_cast<long long>(dropped), stages_json.c_str(),
                stopped.empty() ? "" : (", \"stopped\": " + JsonQuote(stopped)).c_str());
  } else {
    std::printf("%lld frames in %.2f s: %.1f frames/s, %lld dropped%s%s\n", static_cast<long long>(answered), seconds,
                fps, static_cast<long long>(dropped), stopped.empty() ? "" : (" (" + stopped + ")").c_str(),
                stages_text.c_str());
  }
  std::fflush(stdout);
  if (interrupted) return 130;
  if (!error.empty()) throw Refused(error, kSource);
  return 0;
}

// ------------------------------------------------------------------------------------------------
// Language models: generate.py's generate() and VmSteps, and run.py's run_language_model, in C++
// ------------------------------------------------------------------------------------------------
struct ContextFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A small host array staged as a device tensor for one call
Value HostArray(Runtime* rt, const std::string& name, const DType& dtype, std::vector<int64_t> shape,
                const std::vector<int64_t>& values) {
  if (dtype.kind == 'f') refuse("manifest generate: " + name + " cannot be " + dtype.name);
  TensorSpec spec;
  spec.name = name;
  spec.dtype = dtype;
  spec.shape = std::move(shape);
  std::vector<uint8_t> data(values.size() * size_t(dtype.bytes));
  for (size_t k = 0; k < values.size(); ++k) {
    int64_t v = values[k];
    uint8_t* at = &data[k * size_t(dtype.bytes)];
    switch (dtype.bytes) {
      case 1: { int8_t x = int8_t(v); std::memcpy(at, &x, 1); break; }
      case 2: { int16_t x = int16_t(v); std::memcpy(at, &x, 2); break; }
      case 4: { int32_t x = int32_t(v); std::memcpy(at, &x, 4); break; }
      default: std::memcpy(at, &v, 8);
    }
  }
  spec.bytes = data.size();
  return rt->Tensor(spec, data.data());
}

class Steps {
 public:
  Steps(Runtime* rt, const Bundle::Generate& g) : rt_(rt), g_(g) {
    for (const Bundle::Step& s : g.steps) {
      if (s.kind == "prefill") by_bucket_[s.prompt] = &s;
      else if (s.kind == "decode") decoding_[s.capacity] = &s;
      else if (s.kind == "grow") growing_[s.prompt] = &s;
      else refuse("manifest generate.steps: unknown kind '" + s.kind + "'");
      Value f = Call(rt->get_function.obj(), {Obj(rt->vm), Str(s.function.c_str()), Bool(false)}, s.function);
      if (!f.obj()) refuse(s.function + " is not in the bundle's library; the bundle is damaged");
      functions_[s.function] = std::move(f);
    }
    if (by_bucket_.empty() || decoding_.empty()) refuse("manifest generate.steps has no prefill or no decode step");
    for (auto& kv : by_bucket_) buckets_.push_back(kv.first);
  }

  // generate.py's generate: the prompt's prefill (the rest of a long prompt one token a time), then one token per
  // call of next(); each token sampled from the logits before it
  void Start(const std::vector<int64_t>& prompt) {
    size_t n = prompt.size();
    if (n == 0) refuse_usage("the prompt has no tokens");
    if (int64_t(n) >= g_.context)
      throw ContextFull("the prompt is " + std::to_string(n) + " tokens; this bundle's context holds " +
                        std::to_string(g_.context) + " (prompt and answer)");
    int64_t bucket = buckets_.back();
    for (int64_t b : buckets_)
      if (b >= int64_t(n)) { bucket = b; break; }
    size_t first = std::min(n, size_t(bucket));
    std::vector<int64_t> ids(size_t(bucket), 0), positions(size_t(bucket), 0), mask(size_t(bucket), 1);
    for (size_t k = 0; k < first; ++k) ids[k] = prompt[k];
    for (size_t k = 0; k < size_t(bucket); ++k) positions[k] = int64_t(k);
    std::map<std::string, Value> feeds;
    feeds["input_ids"] = HostArray(rt_, "input_ids", g_.ids_dtype, {1, bucket}, ids);
    feeds["position_ids"] = HostArray(rt_, "position_ids", g_.ids_dtype, {1, bucket}, positions);
    feeds["attention_mask"] = HostArray(rt_, "attention_mask", g_.mask_dtype, {1, bucket}, mask);
    feeds["last"] = HostArray(rt_, "last", ParseDType("int64"), {1}, {int64_t(first) - 1});
    cache_.clear();
    CallStep(*by_bucket_[bucket], &feeds);
    for (size_t position = first; position < n; ++position) Decode(prompt[position], int64_t(position));
    position_ = int64_t(n);
  }
  const std::vector<float>& logits() const { return logits_; }
  // the cache holds one more token; false where the context is full (generate.py stops there)
  bool Next(int64_t token) {
    if (position_ >= g_.context) return false;
    Decode(token, position_++);
    return true;
  }

 private:
  Runtime* rt_;
  const Bundle::Generate& g_;
  std::map<int64_t, const Bundle::Step*> by_bucket_, decoding_, growing_;
  std::vector<int64_t> buckets_;
  std::map<std::string, Value> functions_;
  std::vector<Value> cache_;
  std::vector<float> logits_;
  int64_t capacity_ = 0, position_ = 0;

  static Value Borrowed(const TVMFFIAny& any) {  // an owned reference to an element of a returned array
    Value v;
    v.any = any;
    if (v.obj()) ffi.inc_ref(v.obj());
    return v;
  }

  void CallStep(const Bundle::Step& step, std::map<std::string, Value>* feeds) {
    std::vector<TVMFFIAny> args;
    size_t next_cache = 0;
    for (const std::string& name : step.inputs) {
      if (name.rfind("past_key_values.", 0) == 0) {
        if (next_cache >= cache_.size()) refuse(step.function + " takes more cache tensors than the step before gave");
        args.push_back(Obj(cache_[next_cache++]));
      } else {
        auto it = feeds->find(name);
        if (it == feeds->end()) refuse(step.function + " takes an input '" + name + "' edgeq-run does not make");
        args.push_back(Obj(it->second));
      }
    }
    for (const Value& w : rt_->params) args.push_back(Obj(w));
    Value result = Call(functions_[step.function].obj(), args, "running " + step.function);
    TakeResult(result, true);
    capacity_ = step.capacity;
  }

  void TakeResult(const Value& result, bool with_logits) {
    if (result.any.type_index != kTVMFFIArray) refuse("a step returned something other than a list of tensors");
    auto* cell = reinterpret_cast<TVMFFISeqCell*>(reinterpret_cast<char*>(result.obj()) + sizeof(TVMFFIObject));
    auto* elems = static_cast<TVMFFIAny*>(cell->data);
    std::vector<Value> cache;
    for (int64_t k = 0; k < cell->size; ++k) {
      if (elems[k].type_index != kTVMFFITensor) refuse("a step returned something other than tensors");
      if (k == 0 && with_logits) {
        DLTensor* t = TVMFFITensorGetDLTensorPtr(elems[k].v_obj);
        if (t->dtype.code != kDLFloat || t->dtype.bits != 32 || t->dtype.lanes != 1)
          refuse("a step returned its logits as " + DTypeText(t->dtype) + ", not float32");
        int64_t count = 1;
        for (int32_t d = 0; d < t->ndim; ++d) count *= t->shape[d];
        if (count != g_.vocab)
          refuse("a step returned " + std::to_string(count) + " logits; the manifest's vocabulary is " +
                 std::to_string(g_.vocab));
        logits_.resize(size_t(count));
        TVMFFIAny dl{};
        dl.type_index = kTVMFFIDLTensorPtr;
        dl.v_ptr = t;
        Call(rt_->copy_to.obj(), {dl, Ptr(logits_.data()), Int(count * 4)}, "copying the logits back");
        continue;
      }
      cache.push_back(Borrowed(elems[k]));
    }
    cache_ = std::move(cache);
  }

  void Decode(int64_t token, int64_t position) {
    while (position >= capacity_) {  // the cache is full: copied into the next capacity's
      auto grow = growing_.find(capacity_);
      if (grow == growing_.end()) refuse("manifest generate.steps cannot grow the cache past " + std::to_string(capacity_));
      std::vector<TVMFFIAny> args;
      for (const Value& c : cache_) args.push_back(Obj(c));
      Value result = Call(functions_[grow->second->function].obj(), args, "running " + grow->second->function);
      TakeResult(result, false);
      capacity_ = grow->second->capacity;
    }
    auto step = decoding_.find(capacity_);
    if (step == decoding_.end()) refuse("manifest generate.steps has no decode step for " + std::to_string(capacity_) + " slots");
    std::vector<int64_t> mask(size_t(capacity_ + 1), 0);  // generate.py's decode_feeds
    for (int64_t k = 0; k < position; ++k) mask[size_t(k)] = 1;
    mask[size_t(capacity_)] = 1;
    std::map<std::string, Value> feeds;
    feeds["input_ids"] = HostArray(rt_, "input_ids", g_.ids_dtype, {1, 1}, {token});
    feeds["position_ids"] = HostArray(rt_, "position_ids", g_.ids_dtype, {1, 1}, {position});
    feeds["attention_mask"] = HostArray(rt_, "attention_mask", g_.mask_dtype, {1, capacity_ + 1}, mask);
    CallStep(*step->second, &feeds);
  }
};

std::unique_ptr<Tokenizer> LoadTokenizer(const Bundle& b) {
  if (b.generate.tokenizer.empty()) return nullptr;
  std::string text = ReadFile(b.dir + "/" + b.generate.tokenizer, size_t(1) << 30, b.generate.tokenizer);
  Json data = JsonParser(text, b.generate.tokenizer).Parse();
  return std::unique_ptr<Tokenizer>(new Tokenizer(data));
}

// the generated token ids (generate.py's generate), each handed to `emit` as it is made; ends after a `stop` id
template <typename Emit>
void Generate(Steps* steps, const Bundle& b, const std::vector<int64_t>& prompt, long max_tokens, Sampler* sampler,
              const std::vector<int64_t>& stop, const Emit& emit) {
  for (int64_t t : prompt)
    if (t >= b.generate.vocab)
      refuse_usage("prompt token id " + std::to_string(*std::max_element(prompt.begin(), prompt.end())) +
                   " is outside the vocabulary (0.." + std::to_string(b.generate.vocab - 1) + ")");
  try {
    steps->Start(prompt);
  } catch (const ContextFull& err) {
    refuse_usage(std::string(err.what()) + "; give a shorter prompt, or package with a larger --max-context");
  }
  for (long k = 0; k < max_tokens; ++k) {
    int64_t token = (*sampler)(steps->logits());
    emit(token);
    if (std::find(stop.begin(), stop.end(), token) != stop.end()) return;
    if (!steps->Next(token)) return;
  }
}

std::string JsonText(const std::string& utf8) {  // run.py's json.dumps of a str: ASCII, \uXXXX (surrogate pairs)
  std::string out = "\"";
  for (size_t i = 0; i < utf8.size();) {
    uint32_t cp = 0;
    size_t len = Utf8At(utf8, i, &cp);
    if (!len) { cp = 0xFFFD; len = 1; }
    i += len;
    char buf[16];
    if (cp == '"') out += "\\\"";
    else if (cp == '\\') out += "\\\\";
    else if (cp == '\n') out += "\\n";
    else if (cp == '\r') out += "\\r";
    else if (cp == '\t') out += "\\t";
    else if (cp == '\b') out += "\\b";
    else if (cp == '\f') out += "\\f";
    else if (cp < 0x20 || (cp >= 0x7F && cp < 0x10000)) { std::snprintf(buf, sizeof buf, "\\u%04x", cp); out += buf; }
    else if (cp >= 0x10000) {
      uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      out += buf;
    } else out += char(cp);
  }
  return out + "\"";
}

std::string IdList(const std::vector<int64_t>& ids) {
  std::string out = "[";
  for (size_t k = 0; k < ids.size(); ++k) out += (k ? ", " : "") + std::to_string(ids[k]);
  return out + "]";
}

int RunLanguageModel(const Bundle& b, const Args& args) {
  if (!args.inputs.empty() || args.benchmark)
    refuse_usage("this bundle is a language model: give --prompt TEXT (or --prompt-ids) and --max-tokens N; --json "
                 "reports tokens per second");
  std::unique_ptr<Tokenizer> tokenizer = LoadTokenizer(b);
  if (args.has_tokenize) {  // the prompt's token ids, without running the model
    if (!tokenizer) refuse_usage("this bundle has no tokenizer (packaged without tokenizer.json)");
    CodePoints(args.tokenize, "--tokenize");
    std::vector<int64_t> ids = tokenizer->Encode(args.tokenize);
    if (args.json) std::printf("{\"ids\": %s}\n", IdList(ids).c_str());
    else std::printf("%s\n", IdList(ids).c_str());
    return 0;
  }
  std::vector<int64_t> prompt;  // what run.py checks before loading the model, in its order
  if (args.has_prompt) {
    if (!tokenizer) refuse_usage("this bundle has no tokenizer (packaged without tokenizer.json): give --prompt-ids");
    CodePoints(args.prompt, "--prompt");
    std::string text = args.prompt;
    if (args.chat) {
      if (!b.generate.chat) refuse_usage("this bundle has no chat template: leave out --chat");
      text = b.generate.chat_prefix + text + b.generate.chat_suffix;
    }
    prompt = tokenizer->Encode(text);
  } else if (args.has_prompt_ids) {
    if (args.chat) refuse_usage("--chat wraps a --prompt TEXT; --prompt-ids are taken as they are");
    prompt = args.prompt_ids;
  }
  std::unique_ptr<Runtime> rt = LoadRuntime(b);
  if (args.check) {
    if (args.json) std::printf("{\"ok\": true}\n");
    else std::printf("ok: this machine can run %s\n", b.bundle_id.c_str());
    return 0;
  }
  Steps steps(rt.get(), b.generate);
  if (args.self_test) {  // run.py's language_self_test: the recorded greedy tokens, exactly
    std::vector<int64_t> recorded[2];
    const char* names[2] = {"prompt", "tokens"};
    for (int k = 0; k < 2; ++k) {
      const TensorSpec* spec = nullptr;
      for (const TensorSpec& g : b.golden)
        if (g.name == names[k]) spec = &g;
      if (!spec || spec->dtype.kind != 'i' || spec->dtype.bytes != 8)
        refuse("the golden file has no prompt and tokens; package the bundle again");
      std::vector<uint8_t> data = ReadRange(b.dir + "/" + b.golden_file, spec->offset, spec->bytes, b.golden_file);
      recorded[k].resize(data.size() / 8);
      if (!data.empty()) std::memcpy(recorded[k].data(), data.data(), data.size());
    }
    const std::vector<int64_t>& want = recorded[1];
    std::vector<int64_t> got;
    Sampler greedy(0.0, 1.0, 0);
    Generate(&steps, b, recorded[0], long(want.size()), &greedy, {}, [&](int64_t t) { got.push_back(t); });
    size_t matched = 0;
    while (matched < std::min(got.size(), want.size()) && got[matched] == want[matched]) ++matched;
    bool ok = got == want;
    if (args.json)
      std::printf("{\"ok\": %s, \"outputs\": [{\"output\": \"tokens\", \"count\": %zu, \"matched\": %zu, \"ok\": %s}]}\n",
                  ok ? "true" : "false", want.size(), matched, ok ? "true" : "false");
    else
      std::printf("%-4s tokens: %zu of %zu recorded greedy tokens matched in order\nself-test %s\n", ok ? "ok" : "FAIL",
                  matched, want.size(), ok ? "passed" : "FAILED");
    if (!ok) return kSelfTestFailed;
  }
  if (!args.has_prompt && !args.has_prompt_ids) return 0;
  Sampler sampler(args.temperature, args.top_p, args.seed);
  std::unique_ptr<StreamDecoder> decoder(tokenizer ? new StreamDecoder(tokenizer.get()) : nullptr);
  using Clock = std::chrono::steady_clock;
  Clock::time_point start = Clock::now(), first;
  bool have_first = false;
  std::vector<int64_t> generated;
  const std::vector<int64_t> no_stop, &stop = args.ignore_eos ? no_stop : b.generate.stop;
  Generate(&steps, b, prompt, args.max_tokens, &sampler, stop, [&](int64_t token) {
    if (!have_first) first = Clock::now(), have_first = true;
    generated.push_back(token);
    if (args.json) {
      std::string text = decoder ? JsonText(decoder->Push(token)) : "null";
      std::printf("{\"token\": %lld, \"text\": %s}\n", static_cast<long long>(token), text.c_str());
    } else if (decoder) {
      std::string text = decoder->Push(token);
      std::fwrite(text.data(), 1, text.size(), stdout);
    } else {
      std::printf("%lld ", static_cast<long long>(token));
    }
    std::fflush(stdout);
  });
  Clock::time_point end = Clock::now();
  std::string tail = decoder ? decoder->Flush() : "";
  size_t decode_tokens = generated.empty() ? 0 : generated.size() - 1;
  bool stopped = !generated.empty() && std::find(stop.begin(), stop.end(), generated.back()) != stop.end();
  const char* why = stopped ? "stop token"
                    : int64_t(prompt.size() + generated.size()) >= b.generate.context ? "context full" : "max tokens";
  double first_ms = std::chrono::duration<double, std::milli>(first - start).count();
  double per_s = decode_tokens ? double(decode_tokens) / std::chrono::duration<double>(end - first).count() : 0;
  std::string rate = decode_tokens ? JsonNumber(std::round(per_s * 100) / 100) : "null";
  if (args.json) {
    if (!tail.empty()) std::printf("{\"token\": null, \"text\": %s}\n", JsonText(tail).c_str());
    std::printf("{\"summary\": {\"prompt_tokens\": %zu, \"tokens\": %zu, \"stopped\": \"%s\", \"first_token_ms\": %s, "
                "\"decode_tokens_per_s\": %s}}\n", prompt.size(), generated.size(), why,
                JsonNumber(std::round(first_ms * 100) / 100).c_str(), rate.c_str());
  } else {
    std::fwrite(tail.data(), 1, tail.size(), stdout);
    std::printf("\n");
    std::fflush(stdout);
    std::fprintf(stderr, "[%zu prompt tokens, %zu generated (%s); first token %.1f ms, %s tokens/s]\n", prompt.size(),
                 generated.size(), why, first_ms, decode_tokens ? JsonNumber(std::round(per_s * 100) / 100).c_str() : "None");
  }
  return 0;
}

int Main(int argc, char** argv) {
  Args args = ParseArgs(argc, argv);
  std::string dir = BundleDir(args);
  Bundle b = LoadManifest(dir);
  CheckArch(b);
  CheckFiles(b);
  if (!b.cuda_arch.empty()) CheckDriver(b);
  if (b.generate.given) return RunLanguageModel(b, args);
  if (args.has_prompt || args.has_prompt_ids || args.has_tokenize)
    refuse_usage("--prompt, --prompt-ids and --tokenize are for language-model bundles; this one is not");
  std::string stream;  // a video source (video.h), given alone
  for (const std::string& spec : args.inputs) {
    std::string name, path;
    if (!StreamInput(spec, &name, &path)) continue;
    if (args.inputs.size() > 1 || args.benchmark || args.self_test)
      refuse_usage("--input " + spec + " is a video source: give it alone, without --self-test or --benchmark");
    if (!name.empty() && b.preprocess.given && name != b.preprocess.input)
      refuse_usage("--input " + spec + ": video frames go to input '" + b.preprocess.input + "' (--preprocess)");
    stream = path;
    break;
  }
  if (!stream.empty()) {
    if (!b.preprocess.given)
      refuse_usage("--input " + stream + " is a video, and this bundle was packaged without --preprocess: package it "
                   "with --preprocess");
    std::unique_ptr<Runtime> rt = LoadRuntime(b, !args.no_pipeline);
    return RunStream(rt.get(), b, stream, args);
  }
  std::map<std::string, HostTensor> inputs;
  int64_t image_h = 0, image_w = 0;  // the image given, if one was (--postprocess yolo puts boxes in its pixels)
  for (const std::string& spec : args.inputs) {
    size_t eq = spec.find('=');
    {  // a FIFO, a device or a folder is never opened (a FIFO with no writer would block): run.py says the same
      std::string path = eq == std::string::npos ? spec : spec.substr(eq + 1);
      struct stat st;
      if (stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) refuse_usage("--input " + path + " is not a regular file");
    }
    if (eq == std::string::npos || LooksLikeImage(spec.substr(eq + 1))) {  // an image (run.py's read_image)
      std::string path = eq == std::string::npos ? spec : spec.substr(eq + 1);
      if (!b.preprocess.given)
        refuse_usage("--input " + path + " is an image, and this bundle was packaged without --preprocess: give "
                     "NAME=FILE.npy, or package it with --preprocess");
      if (eq != std::string::npos && spec.substr(0, eq) != b.preprocess.input)
        refuse_usage("--input " + spec + ": images go to input '" + b.preprocess.input + "' (--preprocess)");
      Pixels pixels = DecodeImage(path);
      image_h = pixels.h, image_w = pixels.w;
      HostTensor t = ImageTensor(std::move(pixels), b.preprocess);
      inputs[t.name] = std::move(t);
      continue;
    }
    if (eq == 0) refuse_usage("--input '" + spec + "' is not NAME=FILE.npy");
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
    Answered answered = AnswerOf(b, outputs, image_h, image_w);
    const std::vector<int64_t>& real = answered.real;
    const std::string &top_json = answered.json, &top_text = answered.text;
    const char* answer_key = answered.key;
    // outputs are written once the answer is made: a bundle refused while making it leaves no file
    if (!args.output.empty()) {
      size_t n = args.output.size();
      if (n > 4 && args.output.compare(n - 4, 4, ".npz") == 0) {
        WriteNpz(args.output, outputs);
      } else {
        std::string dir = OutputFolder(args.output);
        for (const HostTensor& t : outputs) WriteFileAtomic(dir + "/" + SafeFileName(t.name) + ".npy", NpyBytes(t));
      }
    }
    if (args.json) {
      std::string rows;
      for (size_t i = 0; i < outputs.size(); ++i) {
        const HostTensor& t = outputs[i];
        std::string dims;
        for (size_t k = 0; k < t.shape.size(); ++k) dims += (k ? ", " : "") + std::to_string(t.shape[k]);
        rows += std::string(rows.empty() ? "" : ", ") + JsonQuote(t.name) + ": {\"shape\": [" + dims +
                "], \"dtype\": " + JsonQuote(t.dtype.name) +
                (real[i] >= 0 ? ", \"rows\": " + std::to_string(real[i]) : std::string()) + "}";
      }
      if (b.postprocess.given)
        std::printf("{\"%s\": %s, \"outputs\": {%s}}\n", answer_key, top_json.c_str(), rows.c_str());
      else std::printf("{%s}\n", rows.c_str());
    } else if (b.postprocess.given) {
      std::printf("%s\n", top_text.c_str());
    } else if (args.output.empty()) {
      for (size_t i = 0; i < outputs.size(); ++i) {
        const HostTensor& t = outputs[i];
        std::printf("%s: %s %s%s\n", t.name.c_str(), t.dtype.name.c_str(), ShapeText(t.shape).c_str(),
                    real[i] >= 0 ? (" (" + std::to_string(real[i]) + " real rows)").c_str() : "");
      }
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
