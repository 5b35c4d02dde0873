// tokenizer.h: a language model's byte-level BPE tokenizer (tokenizer.json), its pre-tokenizer's regular expression,
// streaming UTF-8 and the sampler, each written to give what run.py's tokenizer.py and generate.py give
// Part of edgeq-run (edgeq_run.cc includes it; one translation unit, internal linkage as before the split).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "json.h"
#include "refuse.h"
#include "utf8.h"
#include "unicode_categories.h"  // generated from Python's unicodedata (edgeq.runtime.assemble.unicode_header)

namespace {

// Unicode's general category of a code point, as Python's unicodedata.category names it ("Cn": unassigned)
const char* Category(uint32_t cp) {
  size_t lo = 0, hi = sizeof kUnicodeRuns / sizeof kUnicodeRuns[0];
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (kUnicodeRuns[mid][1] < cp) lo = mid + 1;
    else hi = mid;
  }
  if (lo < sizeof kUnicodeRuns / sizeof kUnicodeRuns[0] && kUnicodeRuns[lo][0] <= cp)
    return kUnicodeCategories[kUnicodeRuns[lo][2]];
  return "Cn";
}

// Unicode's White_Space, which the tokenizers' regex engines use for \s (tokenizer.py's WHITE_SPACE)
bool WhiteSpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ------------------------------------------------------------------------------------------------
// A backtracking regular expression over code points: what tokenizer.json's Split patterns use (GPT-2's, Llama 3's,
// Qwen2's), matched as Python's re matches tokenizer.py's rewriting of them (leftmost, alternatives in order).
// Literals and escapes, classes with ranges, \p{..}, \s, \S, \d, \w; groups (?:..), (..), (?i:..); lookahead
// (?!..), (?=..); quantifiers ? * + {n} {n,} {n,m}, greedy or lazy. tokenizer.py's native_problem refuses the rest in
// both loaders.
// ------------------------------------------------------------------------------------------------
class Regex {
 public:
  explicit Regex(const std::string& pattern) : src_(CodePoints(pattern, "the tokenizer's pattern")) {
    root_ = Alternation(false);
    if (at_ != src_.size()) Fail("an unbalanced ')'");
  }

  // Python's re.findall: the non-overlapping matches, leftmost first; code points no match starts at are dropped
  std::vector<std::pair<size_t, size_t>> FindAll(const std::vector<uint32_t>& text) const {
    std::vector<std::pair<size_t, size_t>> out;
    size_t pos = 0, empty_at = size_t(-1);
    while (pos <= text.size()) {
      size_t end = 0;
      bool allow_empty = pos != empty_at;
      bool found = Match(root_, text, pos, [&](size_t j) {
        if (j == pos && !allow_empty) return false;
        end = j;
        return true;
      });
      if (!found) { ++pos; continue; }
      if (end == pos) { empty_at = pos; continue; }
      out.emplace_back(pos, end);
      pos = end;
    }
    return out;
  }

 private:
  struct Item { uint32_t lo, hi; std::string category; int special; bool negated; };  // special: 's', 'd', 'w' or 0
  struct Node {
    enum Kind { kSet, kSeq, kAlt, kRepeat, kLook } kind = kSeq;
    std::vector<Item> items;  // kSet
    bool negated = false;     // kSet: [^...]; kLook: (?!...)
    bool icase = false;
    std::vector<int> kids;
    int min = 0, max = -1;    // kRepeat
    bool greedy = true;
  };
  std::vector<uint32_t> src_;
  size_t at_ = 0;
  std::vector<Node> nodes_;
  int root_ = 0;

  [[noreturn]] void Fail(const std::string& why) const {
    refuse("the tokenizer's pattern cannot be read by edgeq-run (" + why + "); package the bundle again");
  }
  bool More() const { return at_ < src_.size(); }
  uint32_t Peek() const { return src_[at_]; }
  int Add(Node n) { nodes_.push_back(std::move(n)); return int(nodes_.size() - 1); }

  int Alternation(bool icase) {
    Node alt;
    alt.kind = Node::kAlt;
    alt.kids.push_back(Sequence(icase));
    while (More() && Peek() == '|') {
      ++at_;
      alt.kids.push_back(Sequence(icase));
    }
    return alt.kids.size() == 1 ? alt.kids[0] : Add(std::move(alt));
  }
  int Sequence(bool icase) {
    Node seq;
    seq.kind = Node::kSeq;
    while (More() && Peek() != '|' && Peek() != ')') seq.kids.push_back(Quantified(icase));
    return Add(std::move(seq));
  }
  int Number() {
    if (!More() || Peek() < '0' || Peek() > '9') Fail("a count expected in {}");
    int v = 0;
    while (More() && Peek() >= '0' && Peek() <= '9') v = std::min(v * 10 + int(Peek() - '0'), 100000), ++at_;
    return v;
  }
  int Quantified(bool icase) {
    int atom = Atom(icase);
    while (More()) {
      uint32_t c = Peek();
      int lo, hi;
      if (c == '?') lo = 0, hi = 1;
      else if (c == '*') lo = 0, hi = -1;
      else if (c == '+') lo = 1, hi = -1;
      else if (c == '{') {
        size_t save = at_++;
        if (!More() || Peek() < '0' || Peek() > '9') { at_ = save; break; }
        lo = Number();
        hi = lo;
        if (More() && Peek() == ',') {
          ++at_;
          hi = More() && Peek() == '}' ? -1 : Number();
        }
        if (!More() || Peek() != '}') Fail("an unclosed {");
      } else break;
      ++at_;
      Node rep;
      rep.kind = Node::kRepeat;
      rep.min = lo, rep.max = hi;
      rep.kids.push_back(atom);
      if (More() && Peek() == '?') { rep.greedy = false; ++at_; }
      else if (More() && Peek() == '+') Fail("a possessive quantifier");
      atom = Add(std::move(rep));
    }
    return atom;
  }
  // one escape inside or outside a class, as an Item
  Item Escape() {
    if (!More()) Fail("a trailing backslash");
    uint32_t c = src_[at_++];
    Item it{0, 0, "", 0, false};
    switch (c) {
      case 'p': case 'P': {
        if (!More() || Peek() != '{') Fail("\\p without {");
        size_t end = at_;
        while (end < src_.size() && src_[end] != '}') ++end;
        if (end == src_.size()) Fail("an unclosed \\p{");
        for (size_t k = at_ + 1; k < end; ++k) it.category += char(src_[k]);
        at_ = end + 1;
        it.negated = c == 'P';
        return it;
      }
      case 's': case 'S': case 'd': case 'D': case 'w': case 'W':
        it.special = std::tolower(int(c));
        it.negated = c == 'S' || c == 'D' || c == 'W';
        return it;
      case 'n': it.lo = it.hi = '\n'; return it;
      case 'r': it.lo = it.hi = '\r'; return it;
      case 't': it.lo = it.hi = '\t'; return it;
      case 'f': it.lo = it.hi = '\f'; return it;
      case 'v': it.lo = it.hi = '\v'; return it;
      default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
          Fail(std::string("the escape \\") + char(c));
        it.lo = it.hi = c;
        return it;
    }
  }
  int Atom(bool icase) {
    uint32_t c = src_[at_++];
    Node set;
    set.kind = Node::kSet;
    set.icase = icase;
    if (c == '(') {
      bool inner_icase = icase;
      Node look;
      bool is_look = false;
      if (More() && Peek() == '?') {
        ++at_;
        uint32_t k = More() ? src_[at_++] : 0;
        if (k == ':') {
        } else if (k == '!' || k == '=') {
          is_look = true;
          look.kind = Node::kLook;
          look.negated = k == '!';
        } else if (k == 'i' && More() && Peek() == ':') {
          ++at_;
          inner_icase = true;
        } else Fail("the group (?" + std::string(1, char(k)));
      }
      int inner = Alternation(inner_icase);
      if (!More() || Peek() != ')') Fail("an unclosed (");
      ++at_;
      if (!is_look) return inner;
      look.kids.push_back(inner);
      return Add(std::move(look));
    }
    if (c == '[') {
      if (More() && Peek() == '^') { set.negated = true; ++at_; }
      bool first = true;
      while (true) {
        if (!More()) Fail("an unclosed [");
        uint32_t d = src_[at_];
        if (d == ']' && !first) { ++at_; break; }
        first = false;
        ++at_;
        Item it{d, d, "", 0, false};
        if (d == '\\') it = Escape();
        if (it.category.empty() && !it.special && More() && Peek() == '-' && at_ + 1 < src_.size() && src_[at_ + 1] != ']') {
          ++at_;
          uint32_t e = src_[at_++];
          Item hi{e, e, "", 0, false};
          if (e == '\\') hi = Escape();
          if (!hi.category.empty() || hi.special || hi.lo < it.lo) Fail("a bad range in a class");
          it.hi = hi.lo;
        }
        set.items.push_back(it);
      }
      return Add(std::move(set));
    }
    if (c == '\\') {
      set.items.push_back(Escape());
      return Add(std::move(set));
    }
    if (c == '.') {  // any code point but a newline (Python's default)
      set.negated = true;
      set.items.push_back(Item{'\n', '\n', "", 0, false});
      return Add(std::move(set));
    }
    if (c == ')' || c == '*' || c == '+' || c == '?' || c == '{') Fail("a misplaced " + std::string(1, char(c)));
    if (c == '^' || c == '$') Fail("the anchor " + std::string(1, char(c)));
    set.items.push_back(Item{c, c, "", 0, false});
    return Add(std::move(set));
  }

  static bool ItemHas(const Item& it, uint32_t c) {
    bool in;
    if (!it.category.empty()) {
      const char* cat = Category(c);
      in = it.category.size() == 1 ? cat[0] == it.category[0] : it.category == cat;
    } else if (it.special == 's') in = WhiteSpace(c);
    else if (it.special == 'd') in = std::string(Category(c)) == "Nd";
    else if (it.special == 'w') {
      const char* cat = Category(c);
      in = cat[0] == 'L' || cat[0] == 'N' || c == '_';
    } else in = c >= it.lo && c <= it.hi;
    return in != it.negated;
  }
  // Python's re with IGNORECASE on a str: a letter matches its other case, and its simple case folds (s: U+017F,
  // i: U+0130 and U+0131, k: U+212A)
  static bool SameLetter(uint32_t a, uint32_t b) {
    auto lower = [](uint32_t c) -> uint32_t {
      if (c >= 'A' && c <= 'Z') return c + 32;
      if (c == 0x17F) return 's';
      if (c == 0x130 || c == 0x131) return 'i';
      if (c == 0x212A) return 'k';
      return c;
    };
    return lower(a) == lower(b);
  }
  bool SetHas(const Node& n, uint32_t c) const {
    bool in = false;
    for (const Item& it : n.items) {
      if (ItemHas(it, c)) { in = true; break; }
      if (n.icase && it.category.empty() && !it.special && it.lo == it.hi && it.lo < 0x80 && SameLetter(it.lo, c)) {
        in = true;
        break;
      }
    }
    return in != n.negated;
  }

  bool Match(int id, const std::vector<uint32_t>& t, size_t i, const std::function<bool(size_t)>& k) const {
    const Node& n = nodes_[size_t(id)];
    switch (n.kind) {
      case Node::kSet:
        return i < t.size() && SetHas(n, t[i]) && k(i + 1);
      case Node::kSeq:
        return SeqFrom(n, 0, t, i, k);
      case Node::kAlt:
        for (int kid : n.kids)
          if (Match(kid, t, i, k)) return true;
        return false;
      case Node::kLook: {
        bool seen = Match(n.kids[0], t, i, [](size_t) { return true; });
        return seen != n.negated && k(i);
      }
      case Node::kRepeat: {
        const Node& kid = nodes_[size_t(n.kids[0])];
        if (kid.kind == Node::kSet) {  // one code point a time: counted, then tried longest first (or shortest)
          size_t most = 0;
          while (i + most < t.size() && (n.max < 0 || most < size_t(n.max)) && SetHas(kid, t[i + most])) ++most;
          if (most < size_t(n.min)) return false;
          if (n.greedy) {
            for (size_t c = most + 1; c-- > size_t(n.min);)
              if (k(i + c)) return true;
          } else {
            for (size_t c = size_t(n.min); c <= most; ++c)
              if (k(i + c)) return true;
          }
          return false;
        }
        return RepeatFrom(n, 0, t, i, k);
      }
    }
    return false;
  }
  bool SeqFrom(const Node& n, size_t idx, const std::vector<uint32_t>& t, size_t i,
               const std::function<bool(size_t)>& k) const {
    if (idx == n.kids.size()) return k(i);
    return Match(n.kids[idx], t, i, [&](size_t j) { return SeqFrom(n, idx + 1, t, j, k); });
  }
  bool RepeatFrom(const Node& n, int count, const std::vector<uint32_t>& t, size_t i,
                  const std::function<bool(size_t)>& k) const {
    auto more = [&]() {
      return (n.max < 0 || count < n.max) && Match(n.kids[0], t, i, [&](size_t j) {
               return j != i && RepeatFrom(n, count + 1, t, j, k);  // an empty iteration ends the repeat
             });
    };
    if (n.greedy) return more() || (count >= n.min && k(i));
    return (count >= n.min && k(i)) || more();
  }
};

// ------------------------------------------------------------------------------------------------
// Byte-level BPE (tokenizer.py's Tokenizer)
// ------------------------------------------------------------------------------------------------
const char* kGpt2Pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

class Tokenizer {
 public:
  explicit Tokenizer(const Json& data) {
    const Json* model = data.Find("model");
    if (!model || model->kind != Json::kObject) Fail("it has no model");
    const Json* type = model->Find("type");
    if (!type || type->kind != Json::kString || type->str != "BPE") Fail("its model is not byte-level BPE");
    for (const char* key : {"byte_fallback", "dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
      const Json* v = model->Find(key);
      if (v && !(v->kind == Json::kNull || (v->kind == Json::kBool && !v->b) || (v->kind == Json::kString && v->str.empty())))
        Fail("its BPE uses byte fallback, dropout or subword affixes (a SentencePiece-style tokenizer)");
    }
    if (const Json* norm = data.Find("normalizer"); norm && norm->kind != Json::kNull)
      Fail("it normalizes text (Unicode normal forms), which edgeq-run does not implement: run ./run.py, or give "
           "--prompt-ids");
    ReadPreTokenizer(data.Find("pre_tokenizer"));
    for (int b = 0, extra = 0; b < 256; ++b) {  // GPT-2's bytes_to_unicode
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      uint32_t cp = printable ? uint32_t(b) : uint32_t(256 + extra++);
      byte_char_[b].clear();
      AppendUtf8(&byte_char_[b], cp);
      char_byte_[cp] = uint8_t(b);
    }
    const Json& vocab = model->At("vocab", "tokenizer model.");
    if (vocab.kind != Json::kObject) Fail("its vocabulary is not an object");
    vocab_.reserve(vocab.fields.size() * 2);
    for (const auto& kv : vocab.fields) Put(kv.first, int64_t(kv.second.Int("tokenizer vocabulary")));
    const Json* merges = model->Find("merges");
    if (merges && merges->kind == Json::kArray) {
      ranks_.reserve(merges->items.size() * 2);
      int rank = 0;
      for (const Json& m : merges->items) {
        std::string key;
        if (m.kind == Json::kString) key = m.str;
        else if (m.kind == Json::kArray && m.items.size() == 2 && m.items[0].kind == Json::kString &&
                 m.items[1].kind == Json::kString)
          key = m.items[0].str + " " + m.items[1].str;
        else Fail("a merge is neither \"a b\" nor [a, b]");
        ranks_.emplace(std::move(key), rank++);  // the first of equal pairs keeps its rank, as a dict built in order
      }
    }
    if (const Json* unk = model->Find("unk_token"); unk && unk->kind == Json::kString) {
      auto it = vocab_.find(unk->str);
      if (it != vocab_.end()) unknown_ = it->second;
    }
    if (const Json* added = data.Find("added_tokens"); added && added->kind == Json::kArray) {
      for (const Json& t : added->items) {
        const std::string& content = t.At("content", "added_tokens.").Str("added_tokens.content");
        int64_t id = t.At("id", "added_tokens.").Int("added_tokens.id");
        const Json* special = t.Find("special");
        added_.emplace_back(content, id);
        added_ids_.insert(id);
        if (special && special->kind == Json::kBool && special->b) special_.insert(id);
        Put(content, id);
      }
      // longest first; the first of equal lengths as Python's sorted keeps them (stable), by the dict's order
      std::vector<std::pair<std::string, int64_t>> unique;
      std::unordered_map<std::string, size_t> where;
      for (auto& a : added_) {
        auto it = where.find(a.first);
        if (it == where.end()) { where[a.first] = unique.size(); unique.push_back(a); }
        else unique[it->second].second = a.second;  // a later duplicate's id wins, its place stays (a dict)
      }
      added_ = unique;
      std::stable_sort(added_.begin(), added_.end(),
                       [](const auto& a, const auto& b) { return CodePointCount(a.first) > CodePointCount(b.first); });
    }
  }

  std::vector<int64_t> Encode(const std::string& text) {
    std::vector<int64_t> ids;
    size_t start = 0, i = 0;
    while (i < text.size()) {  // the added tokens split out first, longest first, leftmost
      const std::pair<std::string, int64_t>* hit = nullptr;
      for (const auto& a : added_)
        if (!a.first.empty() && text.compare(i, a.first.size(), a.first) == 0) { hit = &a; break; }
      if (!hit) {
        uint32_t cp;
        size_t len = Utf8At(text, i, &cp);
        i += len ? len : 1;
        continue;
      }
      if (i > start) EncodeText(text.substr(start, i - start), &ids);
      ids.push_back(hit->second);
      i += hit->first.size();
      start = i;
    }
    if (start < text.size()) EncodeText(text.substr(start), &ids);
    return ids;
  }

  // the bytes a token stands for (tokenizer.py's token_bytes): "" for a special token and an id outside the vocabulary
  std::string TokenBytes(int64_t id) const {
    if (id < 0 || size_t(id) >= by_id_.size() || !has_id_[size_t(id)]) return "";
    const std::string& token = by_id_[size_t(id)];
    if (added_ids_.count(id)) return special_.count(id) ? "" : token;
    std::string out;
    for (size_t i = 0; i < token.size();) {
      uint32_t cp = 0;
      size_t len = Utf8At(token, i, &cp);
      if (!len) break;
      auto it = char_byte_.find(cp);
      if (it != char_byte_.end()) out += char(it->second);
      i += len;
    }
    return out;
  }

 private:
  std::unique_ptr<Regex> split_;
  bool prefix_space_ = false;
  std::string byte_char_[256];
  std::unordered_map<uint32_t, uint8_t> char_byte_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::unordered_map<std::string, int> ranks_;
  std::vector<std::string> by_id_;
  std::vector<bool> has_id_;
  std::vector<std::pair<std::string, int64_t>> added_;
  std::unordered_set<int64_t> added_ids_, special_;
  int64_t unknown_ = -1;
  std::unordered_map<std::string, std::vector<int64_t>> cache_;

  [[noreturn]] static void Fail(const std::string& why) {
    refuse("the bundle's tokenizer is not supported: " + why);
  }
  static size_t CodePointCount(const std::string& s) {
    size_t n = 0;
    for (char c : s) n += (uint8_t(c) & 0xC0) != 0x80;
    return n;
  }
  void Put(const std::string& token, int64_t id) {
    if (id < 0 || id > (int64_t(1) << 24)) Fail("a token id is out of range");
    vocab_[token] = id;
    if (size_t(id) >= by_id_.size()) by_id_.resize(size_t(id) + 1), has_id_.resize(size_t(id) + 1);
    by_id_[size_t(id)] = token;  // the last token with an id names it, as tokenizer.py's by_id
    has_id_[size_t(id)] = true;
  }
  void ReadPreTokenizer(const Json* spec) {
    if (!spec || spec->kind != Json::kObject) Fail("it has no pre-tokenizer; edgeq's tokenizer reads byte-level ones");
    std::vector<const Json*> items;
    const Json* type = spec->Find("type");
    if (type && type->kind == Json::kString && type->str == "Sequence") {
      for (const Json& item : spec->At("pretokenizers", "pre_tokenizer.").Arr("pre_tokenizer.pretokenizers"))
        items.push_back(&item);
    } else {
      items.push_back(spec);
    }
    std::string pattern;
    bool have_pattern = false, byte_level = false;
    for (const Json* item : items) {
      const Json* kind = item->Find("type");
      std::string k = kind && kind->kind == Json::kString ? kind->str : "";
      if (k == "Split" && !have_pattern && !byte_level) {
        const Json* p = item->Find("pattern");
        const Json* regex = p ? p->Find("Regex") : nullptr;
        const Json* behavior = item->Find("behavior");
        const Json* invert = item->Find("invert");
        if (!regex || regex->kind != Json::kString || !behavior || behavior->kind != Json::kString ||
            behavior->str != "Isolated" || (invert && invert->kind == Json::kBool && invert->b))
          Fail("its Split pre-tokenizer is not an isolating regex");
        pattern = regex->str;
        have_pattern = true;
      } else if (k == "ByteLevel" && !byte_level) {
        byte_level = true;
        const Json* prefix = item->Find("add_prefix_space");
        prefix_space_ = prefix && prefix->kind == Json::kBool && prefix->b;
        const Json* use_regex = item->Find("use_regex");
        if (!use_regex || use_regex->kind != Json::kBool || use_regex->b) {
          if (have_pattern) Fail("its pre-tokenizer splits twice");
          pattern = kGpt2Pattern;
          have_pattern = true;
        }
      } else {
        Fail("its pre-tokenizer " + k + " is not one edgeq's tokenizer reads");
      }
    }
    if (!byte_level) Fail("its pre-tokenizer is not byte-level");
    if (have_pattern) split_.reset(new Regex(pattern));
  }

  const std::vector<int64_t>& Bpe(const std::string& word) {
    auto cached = cache_.find(word);
    if (cached != cache_.end()) return cached->second;
    std::vector<std::string> parts;
    for (size_t i = 0; i < word.size();) {
      uint32_t cp;
      size_t len = Utf8At(word, i, &cp);
      parts.push_back(word.substr(i, len));
      i += len;
    }
    while (parts.size() > 1) {
      int best = -1;
      size_t at = 0;
      for (size_t i = 0; i + 1 < parts.size(); ++i) {
        auto it = ranks_.find(parts[i] + " " + parts[i + 1]);
        if (it != ranks_.end() && (best < 0 || it->second < best)) best = it->second, at = i;
      }
      if (best < 0) break;
      std::string a = parts[at], b = parts[at + 1];
      std::vector<std::string> merged;
      for (size_t i = 0; i < parts.size();) {
        if (i + 1 < parts.size() && parts[i] == a && parts[i + 1] == b) {
          merged.push_back(a + b);
          i += 2;
        } else {
          merged.push_back(parts[i]);
          i += 1;
        }
      }
      parts.swap(merged);
    }
    std::vector<int64_t> ids;
    for (const std::string& p : parts) {  // a piece the vocabulary lacks is dropped without an unknown token
      auto it = vocab_.find(p);
      if (it != vocab_.end()) ids.push_back(it->second);
      else if (unknown_ >= 0) ids.push_back(unknown_);
    }
    if (cache_.size() >= 100000) cache_.clear();
    return cache_[word] = ids;
  }

  void EncodeText(std::string text, std::vector<int64_t>* ids) {
    if (prefix_space_ && !text.empty() && text[0] != ' ') text = " " + text;
    std::vector<uint32_t> cps = CodePoints(text, "the prompt");
    std::vector<std::pair<size_t, size_t>> pieces;
    if (split_) pieces = split_->FindAll(cps);
    else pieces.emplace_back(0, cps.size());
    for (const auto& piece : pieces) {
      if (piece.first == piece.second) continue;
      std::string utf8;
      for (size_t k = piece.first; k < piece.second; ++k) AppendUtf8(&utf8, cps[k]);
      std::string word;
      for (char c : utf8) word += byte_char_[uint8_t(c)];
      const std::vector<int64_t>& got = Bpe(word);
      ids->insert(ids->end(), got.begin(), got.end());
    }
  }
};

// tokenizer.py's Decoder: text as soon as its UTF-8 is complete
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer* tokenizer) : tokenizer_(tokenizer) {}
  std::string Push(int64_t id) {
    std::string data = pending_ + tokenizer_->TokenBytes(id);
    size_t cut = data.size();
    for (size_t back = 1; back <= std::min<size_t>(4, data.size()); ++back) {
      uint8_t byte = uint8_t(data[data.size() - back]);
      if ((byte & 0xC0) == 0x80) continue;
      size_t need = (byte & 0xE0) == 0xC0 ? 2 : (byte & 0xF0) == 0xE0 ? 3 : (byte & 0xF8) == 0xF0 ? 4 : 1;
      if (need > back) cut = data.size() - back;
      break;
    }
    pending_ = data.substr(cut);
    return Utf8Replace(data.substr(0, cut));
  }
  std::string Flush() {
    std::string text = Utf8Replace(pending_);
    pending_.clear();
    return text;
  }

 private:
  const Tokenizer* tokenizer_;
  std::string pending_;
};

// ------------------------------------------------------------------------------------------------
// Sampling (generate.py's SplitMix64 and Sampler, operation for operation)
// ------------------------------------------------------------------------------------------------
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t Next() {
    state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double Uniform() { return double(Next() >> 11) * (1.0 / double(uint64_t(1) << 53)); }
};

class Sampler {
 public:
  Sampler(double temperature, double top_p, uint64_t seed) : temperature_(temperature), top_p_(top_p), rng_(seed) {}

  int64_t operator()(const std::vector<float>& logits) {
    size_t n = logits.size();
    if (temperature_ <= 0.0) {
      size_t best = 0;
      for (size_t i = 1; i < n; ++i)
        if (double(logits[i]) > double(logits[best])) best = i;
      return int64_t(best);
    }
    std::vector<double> scaled(n);
    for (size_t i = 0; i < n; ++i) scaled[i] = double(logits[i]) / temperature_;
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scaled[a] > scaled[b]; });
    double top = scaled[order[0]], total = 0.0;
    std::vector<double> weights(n);
    for (size_t i = 0; i < n; ++i) weights[i] = std::exp(scaled[order[i]] - top), total += weights[i];
    // the fewest most likely tokens whose probability reaches top_p
    size_t keep = n;
    double cumulative = 0.0;
    for (size_t i = 0; i < n; ++i) {
      cumulative += weights[i] / total;
      if (cumulative >= top_p_) { keep = i + 1; break; }
    }
    double kept_total = 0.0;
    for (size_t i = 0; i < keep; ++i) kept_total += weights[i] / total;
    double u = rng_.Uniform();
    cumulative = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      cumulative += (weights[i] / total) / kept_total;
      if (cumulative > u) return int64_t(order[i]);
    }
    return int64_t(order[keep - 1]);
  }

 private:
  double temperature_, top_p_;
  SplitMix64 rng_;
};

}  // namespace
