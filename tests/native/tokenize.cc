// The loader's tokenizer (templates/native/tokenizer.h) alone, for tests/test_llm.py: argv[1] is a tokenizer.json;
// each line of stdin is a JSON string; each line of stdout is its token ids, a tab, and the streaming decoder's
// pieces of those ids in hex (comma-separated, the flushed tail last).
#include <cstdio>
#include <iostream>
#include <string>

#include "files.h"
#include "json.h"
#include "tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  try {
    Json data = JsonParser(ReadFile(argv[1], size_t(1) << 30, "tokenizer.json"), "tokenizer.json").Parse();
    Tokenizer tokenizer(data);
    std::string line;
    while (std::getline(std::cin, line)) {
      std::string text = JsonParser(line, "the line").Parse().str;
      std::vector<int64_t> ids = tokenizer.Encode(text);
      StreamDecoder decoder(&tokenizer);
      std::string out, pieces;
      for (size_t k = 0; k < ids.size(); ++k) out += (k ? "," : "") + std::to_string(ids[k]);
      auto hex = [&](const std::string& piece) {
        std::string h;
        char buf[3];
        for (unsigned char c : piece) std::snprintf(buf, sizeof buf, "%02x", c), h += buf;
        return h;
      };
      for (size_t k = 0; k < ids.size(); ++k) pieces += hex(decoder.Push(ids[k])) + ",";
      pieces += hex(decoder.Flush());
      std::printf("%s\t%s\n", out.c_str(), pieces.c_str());
    }
  } catch (const Refused& err) {
    std::fprintf(stderr, "%s\n", err.what());
    return err.status;
  }
  return 0;
}
