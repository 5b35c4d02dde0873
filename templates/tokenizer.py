"""A byte-level BPE tokenizer read from a Hugging Face ``tokenizer.json`` (GPT-2's scheme: SmolLM, Llama 3,
Qwen2, Phi-3's successors), in the standard library only, so that run.py needs nothing installed. It gives the
ids the ``tokenizers`` library gives (edgeq's tests compare them on a thousand strings).

Encoding: the added (special) tokens are split out first, longest first; the rest is split by the
pre-tokenizer's regular expression; each piece's UTF-8 bytes are mapped to GPT-2's printable characters and
merged by the BPE merge ranks. Python's ``re`` has no ``\\p{L}``/``\\p{N}`` classes, so the expression is
rewritten with explicit character classes built from ``unicodedata`` (letters: categories L*, numbers: N*),
and ``\\s`` with Unicode's White_Space (which ``tokenizers``' regex engine uses; Python's ``\\s`` also matches
the separators U+001C..U+001F). ``supported(data)`` says what of a tokenizer.json this does not implement.

Decoding is byte-exact: ids -> bytes; ``Decoder`` hands out text as soon as its UTF-8 is complete, for streaming.
"""

import json
import re
import sys
import unicodedata

# GPT-2's pre-tokenizer (ByteLevel with use_regex)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_CLASSES = {}


def _ranges(prefix):
    """A character-class body (no brackets) of every code point whose category starts with ``prefix``."""
    if prefix not in _CLASSES:
        parts, start, previous = [], None, None
        for code in range(sys.maxunicode + 1):
            inside = unicodedata.category(chr(code)).startswith(prefix)
            if inside and start is None:
                start = code
            if not inside and start is not None:
                parts.append((start, previous))
                start = None
            previous = code
        if start is not None:
            parts.append((start, previous))
        _CLASSES[prefix] = "".join(re.escape(chr(a)) if a == b else "%s-%s" % (re.escape(chr(a)), re.escape(chr(b)))
                                   for a, b in parts)
    return _CLASSES[prefix]


def python_pattern(pattern):
    """A ``tokenizers`` (Rust regex / Oniguruma) pattern as Python ``re`` source: ``\\p{L}``, ``\\p{N}`` and
    ``\\s`` (inside and outside brackets) spelt out."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in "pP" and pattern[i + 2:i + 3] == "{":
                end = pattern.index("}", i)
                name = pattern[i + 3:end]
                if name not in ("L", "N", "Lu", "Ll", "Lt", "Lm", "Lo", "Nd", "Nl", "No", "P", "S", "M", "Z"):
                    raise ValueError("the tokenizer's pattern uses \\p{%s}, which edgeq's tokenizer does not know" % name)
                body = _ranges(name)
                if nxt == "P":
                    if in_class:
                        raise ValueError("the tokenizer's pattern uses \\P{...} inside a class")
                    out.append("[^%s]" % body)
                else:
                    out.append(body if in_class else "[%s]" % body)
                i = end + 1
                continue
            if nxt in "sS":
                if nxt == "s":
                    out.append(WHITE_SPACE if in_class else "[%s]" % WHITE_SPACE)
                elif in_class:
                    raise ValueError("the tokenizer's pattern uses \\S inside a class")
                else:
                    out.append("[^%s]" % WHITE_SPACE)
                i += 2
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class and out and out[-1] not in ("[", "[^"):
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def bytes_to_unicode():
    """GPT-2's map of the 256 bytes to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def supported(data):
    """What of ``tokenizer.json`` (parsed) this tokenizer does not implement: one line, or None."""
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        return "its model is %s; edgeq's tokenizer reads byte-level BPE" % model.get("type")
    if model.get("byte_fallback") or model.get("dropout") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        return "its BPE uses byte fallback, dropout or subword affixes (a SentencePiece-style tokenizer)"
    normalizer = data.get("normalizer")
    if normalizer is not None and normalizer.get("type") not in ("NFC", "NFD", "NFKC", "NFKD"):
        return "its normalizer is %s" % normalizer.get("type")
    try:
        _pre_tokenizer(data.get("pre_tokenizer"))
    except ValueError as err:
        return str(err)
    return None


def native_problem(pattern):
    """What of a Split pattern edgeq-run's regular expressions (tokenizer.h) do not read, or None: both loaders
    then refuse the same tokenizers. They read literals and escapes (\\p{..}, \\s, \\d, \\w, \\n, \\r, \\t, \\f,
    \\v and punctuation), classes, groups (..), (?:..), (?i:..), lookahead (?!..) and (?=..), and the quantifiers ? * +
    {n} {n,} {n,m}, greedy or lazy."""
    i, in_class, quantified = 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1:i + 2]
            if nxt.isascii() and nxt.isalnum() and nxt not in "pPsSdDwWnrtfv":
                return "its pattern uses the escape \\%s" % nxt
            i = pattern.index("}", i) + 1 if nxt in "pP" and pattern[i + 2:i + 3] == "{" else i + 2
            quantified = False
            continue
        if in_class:
            in_class = c != "]"
            i += 1
            continue
        if c == "[":  # a "]" first in a class (after "^") is a literal, as in Python's re
            in_class = True
            i += 2 if pattern[i + 1:i + 2] == "^" else 1
            i += pattern[i:i + 1] == "]"
            continue
        if c in "^$":
            return "its pattern uses the anchor %s" % c
        if c == "(" and pattern[i + 1:i + 2] == "?" and not pattern.startswith(("(?:", "(?!", "(?=", "(?i:"), i):
            return "its pattern uses the group %s" % pattern[i:i + 3]
        if c == "+" and quantified:
            return "its pattern uses a possessive quantifier"
        if c == "{" and pattern[i + 1:i + 2].isdigit():
            i = pattern.index("}", i)
            c = "}"
        quantified = c in "+*?}" and not quantified
        i += 1
    return None


def _pre_tokenizer(spec):
    """(split pattern or None, add_prefix_space) of a ByteLevel pre-tokenizer, alone or after one Split."""
    if spec is None:
        raise ValueError("it has no pre-tokenizer; edgeq's tokenizer reads byte-level ones")
    items = spec["pretokenizers"] if spec.get("type") == "Sequence" else [spec]
    pattern, prefix, byte_level = None, False, False
    for item in items:
        kind = item.get("type")
        if kind == "Split" and pattern is None and not byte_level:
            regex = item.get("pattern", {}).get("Regex")
            if regex is None or item.get("behavior") != "Isolated" or item.get("invert"):
                raise ValueError("its Split pre-tokenizer is not an isolating regex")
            pattern = regex
        elif kind == "ByteLevel" and not byte_level:
            byte_level = True
            prefix = bool(item.get("add_prefix_space"))
            if item.get("use_regex", True):
                if pattern is not None:
                    raise ValueError("its pre-tokenizer splits twice")
                pattern = GPT2_PATTERN
        else:
            raise ValueError("its pre-tokenizer %s is not one edgeq's tokenizer reads" % kind)
    if not byte_level:
        raise ValueError("its pre-tokenizer is not byte-level")
    problem = native_problem(pattern) if pattern else None
    if problem:
        raise ValueError(problem)
    return pattern, prefix


class Tokenizer:
    def __init__(self, data):
        problem = supported(data)
        if problem:
            raise ValueError("the tokenizer is not supported: " + problem)
        model = data["model"]
        self.vocab = dict(model["vocab"])
        self.unknown = self.vocab.get(model.get("unk_token"))
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
        self.special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
        self.added_ids = set(self.added.values())
        self.vocab.update(self.added)
        self.by_id = {i: t for t, i in self.vocab.items()}
        normalizer = data.get("normalizer")
        self.normal_form = normalizer["type"] if normalizer else None
        pattern, self.prefix_space = _pre_tokenizer(data["pre_tokenizer"])
        self.split = re.compile(python_pattern(pattern)) if pattern else None
        self.added_split = re.compile("|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True))) \
            if self.added else None
        self.byte_char = bytes_to_unicode()
        self.char_byte = {c: b for b, c in self.byte_char.items()}
        self.cache = {}

    @classmethod
    def from_file(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    def _bpe(self, word):
        ids = self.cache.get(word)
        if ids is not None:
            return ids
        parts = list(word)
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                rank = self.ranks.get((parts[i], parts[i + 1]))
                if rank is not None and (best is None or rank < best):
                    best, at = rank, i
            if best is None:
                break
            pair, merged, i = (parts[at], parts[at + 1]), [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        # a byte the vocabulary lacks is dropped, as ``tokenizers`` does without an unknown token
        ids = [self.vocab[p] if p in self.vocab else self.unknown for p in parts]
        ids = [i for i in ids if i is not None]
        if len(self.cache) < 100000:
            self.cache[word] = ids
        return ids

    def _encode_text(self, text):
        if self.normal_form:
            text = unicodedata.normalize(self.normal_form, text)
        if self.prefix_space and text and not text.startswith(" "):
            text = " " + text
        pieces = self.split.findall(text) if self.split else [text]
        ids = []
        for piece in pieces:
            if piece:
                ids.extend(self._bpe("".join(self.byte_char[b] for b in piece.encode("utf-8"))))
        return ids

    def encode(self, text):
        """The token ids of ``text`` (no special tokens added around it)."""
        ids, start = [], 0
        for match in (self.added_split.finditer(text) if self.added_split else []):
            if match.start() > start:
                ids.extend(self._encode_text(text[start:match.start()]))
            ids.append(self.added[match.group()])
            start = match.end()
        if start < len(text):
            ids.extend(self._encode_text(text[start:]))
        return ids

    def token_bytes(self, token_id, skip_special=True):
        """The bytes token ``token_id`` stands for (b"" for a special token when ``skip_special``, and for an id
        outside the vocabulary)."""
        token = self.by_id.get(token_id)
        if token is None:  # a model's logits may outnumber its tokenizer's vocabulary: such ids decode to nothing,
            return b""     # as in ``tokenizers``
        if token_id in self.added_ids:
            return b"" if skip_special and token_id in self.special else token.encode("utf-8")
        return bytes(self.char_byte[c] for c in token)

    def decode(self, ids, skip_special=True):
        return b"".join(self.token_bytes(i, skip_special) for i in ids).decode("utf-8", errors="replace")


class Decoder:
    """Streams text: ``push(id)`` returns what of the bytes so far is complete UTF-8, ``flush()`` the rest."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = b""

    def push(self, token_id):
        data = self.pending + self.tokenizer.token_bytes(token_id)
        cut = len(data)
        for back in range(1, min(4, len(data)) + 1):  # an incomplete sequence at the end waits for its bytes
            byte = data[-back]
            if byte & 0xC0 == 0x80:
                continue
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            if need > back:
                cut = len(data) - back
            break
        self.pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self):
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text
