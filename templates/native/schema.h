// schema.h: the manifest checked against contract.Manifest as contract.Record.from_json checks it, field by field
// in the same order, with the same words, from the tables contract.h carries (generated from contract.py). So
// edgeq-run and run.py refuse the same manifests, with the same line, before either reads a field for itself.
// Part of edgeq-run (edgeq_run.cc includes it).
#pragma once

#include <cctype>
#include <cmath>
#include <string>

#include "contract.h"
#include "json.h"
#include "refuse.h"

namespace {

std::string SchemaKindName(int kind) {  // contract._Kind.name
  const SchemaKind& k = kSchemaKinds[kind];
  switch (k.tag) {
    case 's': return "text";
    case 'i': return "an integer";
    case 'c': return "a count (an integer >= 0)";
    case 'n': return "a number";
    case 'b': return "true or false";
    case 'j': return "JSON";
    case 'o': return "an object";
    case '?': return SchemaKindName(k.arg) + " or null";
    case 'l': return "a list";
    default: return "an object";  // 'd', 'r'
  }
}

bool SchemaPlain(char tag) { return tag == 's' || tag == 'i' || tag == 'c' || tag == 'n' || tag == 'b' || tag == 'j' || tag == 'o'; }

// contract._Kind.check: Python's json gives int for integral text, float otherwise; bool is not an int there
bool SchemaPlainOk(char tag, const Json& v) {
  switch (tag) {
    case 's': return v.kind == Json::kString;
    case 'i': return v.kind == Json::kNumber && v.integral;
    case 'c': return v.kind == Json::kNumber && v.integral && v.i >= 0;
    case 'n': return v.kind == Json::kNumber && std::isfinite(v.num);
    case 'b': return v.kind == Json::kBool;
    case 'o': return v.kind == Json::kObject;
    default: return true;  // 'j'
  }
}

[[noreturn]] void SchemaRefuse(const std::string& where, const std::string& what) {
  refuse("manifest field '" + where + "' " + what);
}

void CheckRecord(const Json& v, int record, const std::string& where);

void CheckKind(const Json* v, int kind, const std::string& where) {  // v null: the field is absent (Python: None)
  const SchemaKind& k = kSchemaKinds[kind];
  if (k.tag == '?') {
    if (!v || v->kind == Json::kNull) return;
    if (SchemaPlain(kSchemaKinds[k.arg].tag) && !SchemaPlainOk(kSchemaKinds[k.arg].tag, *v))
      SchemaRefuse(where, "is not " + SchemaKindName(kind));
    CheckKind(v, k.arg, where);
    return;
  }
  static const Json kNone;
  const Json& value = v ? *v : kNone;
  if (SchemaPlain(k.tag)) {
    if (!SchemaPlainOk(k.tag, value)) SchemaRefuse(where, "is not " + SchemaKindName(kind));
  } else if (k.tag == 'l') {
    if (value.kind != Json::kArray) SchemaRefuse(where, "is not a list");
    for (size_t i = 0; i < value.items.size(); ++i) CheckKind(&value.items[i], k.arg, where + "[" + std::to_string(i) + "]");
  } else if (k.tag == 'd') {
    if (value.kind != Json::kObject) SchemaRefuse(where, "is not an object");
    for (const auto& kv : value.fields) CheckKind(&kv.second, k.arg, where + "." + kv.first);
  } else {
    CheckRecord(value, k.arg, where);
  }
}

void CheckRecord(const Json& v, int record, const std::string& where) {  // contract.Record.from_json
  if (v.kind != Json::kObject) SchemaRefuse(where.empty() ? "(top level)" : where, "is not an object");
  const SchemaRecord& r = kSchemaRecords[record];
  for (int f = r.first; f < r.first + r.count; ++f) {
    const SchemaField& field = kSchemaFields[f];
    std::string name = (where.empty() ? "" : where + ".") + field.name;
    const Json* value = v.Find(field.name);
    if (!value && kSchemaKinds[field.kind].tag != '?') SchemaRefuse(name, "is missing");
    CheckKind(value, field.kind, name);
  }
  if (record == kQuantizationRecord) {  // QuantizationReport.from_json
    const std::string& kind = v.Find("kind")->str;
    bool known = false;
    std::string names;
    for (const char* k : kQuantKinds) known = known || kind == k, names += (names.empty() ? "" : ", ") + std::string(k);
    if (!known) SchemaRefuse(where + ".kind", "is not one of " + names);
  }
}

// contract.Manifest.from_json: the schema version first (as Python compares it: 2.0 and true may equal 2 and 1),
// then every record
void CheckManifestSchema(const Json& m) {
  if (m.kind == Json::kObject) {
    const Json* version = m.Find("schema_version");
    bool same = version && ((version->kind == Json::kNumber && version->num == double(kSchemaVersion)) ||
                            (version->kind == Json::kBool && int(version->b) == kSchemaVersion));
    if (!same)
      refuse("manifest schema_version is not " + std::to_string(kSchemaVersion) +
             ": made by another edgeq version; use the loader inside the bundle or an edgeq of that version");
  }
  CheckRecord(m, 0, "");
}

// safebundle.NAME / FILE_NAME / HEX64
bool SchemaName(const std::string& s, size_t from = 0) {
  size_t n = s.size() - from;
  if (from > s.size() || n < 1 || n > 128 || !std::isalnum(uint8_t(s[from])) || uint8_t(s[from]) >= 0x80) return false;
  for (size_t k = from; k < s.size(); ++k) {
    uint8_t c = uint8_t(s[k]);
    if (c >= 0x80 || !(std::isalnum(c) || c == '.' || c == '_' || c == '-')) return false;
  }
  return true;
}
bool SchemaFileName(const std::string& s) { return SchemaName(s, s.rfind("runtime/", 0) == 0 ? 8 : 0); }
bool SchemaHex64(const std::string& s) {
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// safebundle.check_manifest after the schema, in its order: names, the file list, the files each section names
void CheckManifestFiles(const Json& m) {
  if (!SchemaName(m.Find("bundle_id")->str) || !SchemaName(m.Find("name")->str))
    refuse("manifest bundle_id or name is not valid");
  const Json& files = *m.Find("files");
  const Json& sizes = *m.Find("sizes");
  bool same = files.fields.size() == sizes.fields.size() && !files.fields.empty();
  for (const auto& kv : files.fields) same = same && sizes.Find(kv.first);
  for (const auto& kv : sizes.fields) same = same && files.Find(kv.first);
  if (!same) refuse("manifest 'files' and 'sizes' must name the same files");
  for (const auto& kv : files.fields) {
    if (!SchemaFileName(kv.first) || kv.first == "manifest.json" || kv.first == "manifest.sig" || kv.first == "SHA256SUMS")
      refuse("manifest lists an unsafe file name '" + kv.first + "'");
    if (!SchemaHex64(kv.second.str)) refuse("manifest hash of " + kv.first + " is not a SHA-256");
  }
  for (const char* section : {"library", "weights", "golden"})
    if (!files.Find(m.Find(section)->Find("file")->str))
      refuse(std::string("manifest ") + section + ".file is not one of the bundle's files");
  const Json* runtime = m.Find("runtime");
  if (runtime && runtime->kind == Json::kObject) {
    bool listed = files.Find(runtime->Find("loader")->str) != nullptr;
    for (const Json& lib : runtime->Find("libraries")->items) listed = listed && files.Find(lib.str);
    if (!listed) refuse("manifest runtime.loader / runtime.libraries are not the bundle's files");
  }
}

}  // namespace
