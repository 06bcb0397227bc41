// The filter language's parser and compiler (filter_compiler.h): one implementation for Python's predictor and
// silverrec-predictor. Error messages are the product's (docs/filtering.md), character for character.
#include "filter_compiler.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "constants.h"

namespace silverrec {

namespace {

// ------------------------------------------------------------------------------------------------ text
// A filter string as characters (Unicode code points, as Python's str counts them) over its UTF-8 bytes.
struct Text {
  std::string bytes;
  std::vector<char32_t> cp;
  std::vector<size_t> at;  // at[i]: the byte offset of character i; at[n]: the end

  explicit Text(std::string s) : bytes(std::move(s)) {
    size_t i = 0;
    while (i < bytes.size()) {
      const unsigned char c = static_cast<unsigned char>(bytes[i]);
      const size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
      char32_t v = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
      size_t n = 1;
      for (; n < len && i + n < bytes.size(); ++n) v = (v << 6) | (static_cast<unsigned char>(bytes[i + n]) & 0x3f);
      at.push_back(i);
      cp.push_back(v);
      i += n;
    }
    at.push_back(bytes.size());
  }
  size_t size() const { return cp.size(); }
  std::string sub(size_t lo, size_t hi) const { return bytes.substr(at[lo], at[hi] - at[lo]); }
};

// Python's str.isspace (what the regex \s matches in a str pattern).
bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

bool is_bare(char32_t c) {  // [A-Za-z0-9_.:/+\-]
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == ':' || c == '/' || c == '+' || c == '-';
}

std::string upper(std::string s) {
  for (char& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

const char* const kKeywords[] = {"AND", "OR", "NOT", "IN"};

bool is_keyword(const std::string& word) {
  const std::string u = upper(word);
  return std::any_of(std::begin(kKeywords), std::end(kKeywords), [&](const char* k) { return u == k; });
}

// "filter syntax error at position P: message", then the string around P (60 characters) and a caret under P.
[[noreturn]] void syntax_error(const std::string& message, const Text& text, size_t pos) {
  const size_t width = 60, n = text.size();
  const size_t lo = pos > width / 2 ? pos - width / 2 : 0, hi = std::min(n, lo + width);
  const std::string prefix = lo > 0 ? "..." : "";
  const std::string snippet = prefix + text.sub(lo, hi) + (hi < n ? "..." : "");
  const std::string caret = std::string(prefix.size() + pos - lo, ' ') + "^";
  throw RequestError("filter syntax error at position " + std::to_string(pos) + ": " + message + "\n  " + snippet +
                     "\n  " + caret);
}

// ------------------------------------------------------------------------------------------------ tokens
enum class Tok { Name, String, Keyword, LParen, RParen, Comma, Eq, Ne, End };

struct Token {
  Tok kind;
  std::string text;  // a keyword upper-cased, a string's value unquoted
  size_t pos;
};

std::string read_quoted(const Text& text, size_t start, size_t& end) {
  const char32_t quote = text.cp[start];
  std::string out;
  size_t i = start + 1;
  while (i < text.size()) {
    const char32_t c = text.cp[i];
    if (c == '\\' && i + 1 < text.size()) {
      out += text.sub(i + 1, i + 2);
      i += 2;
    } else if (c == quote) {
      end = i + 1;
      return out;
    } else {
      out += text.sub(i, i + 1);
      ++i;
    }
  }
  syntax_error(std::string("unterminated string starting with ") + char(quote), text, start);
}

std::vector<Token> tokenize(const Text& text) {
  std::vector<Token> out;
  size_t i = 0;
  while (i < text.size()) {
    const char32_t c = text.cp[i];
    if (is_space(c)) {
      ++i;
    } else if (c == '(' || c == ')' || c == ',' || c == '=') {
      const Tok kind = c == '(' ? Tok::LParen : c == ')' ? Tok::RParen : c == ',' ? Tok::Comma : Tok::Eq;
      out.push_back({kind, std::string(1, char(c)), i++});
    } else if (c == '!' && i + 1 < text.size() && text.cp[i + 1] == '=') {
      out.push_back({Tok::Ne, "!=", i});
      i += 2;
    } else if (c == '\'' || c == '"') {
      size_t end = i;
      std::string value = read_quoted(text, i, end);
      out.push_back({Tok::String, std::move(value), i});
      i = end;
    } else if (is_bare(c)) {
      size_t j = i;
      while (j < text.size() && is_bare(text.cp[j])) ++j;
      const std::string word = text.sub(i, j);
      if (is_keyword(word)) out.push_back({Tok::Keyword, upper(word), i});
      else out.push_back({Tok::Name, word, i});
      i = j;
    } else {
      syntax_error("unexpected character " + py_repr(text.sub(i, i + 1)), text, i);
    }
  }
  out.push_back({Tok::End, "", text.size()});
  return out;
}

std::string describe(const Token& tok) {
  if (tok.kind == Tok::End) return "the end of the filter";
  if (tok.kind == Tok::String) return "string " + py_repr(tok.text);
  return py_repr(tok.text);
}

// ------------------------------------------------------------------------------------------------ parser
class Parser {
 public:
  Parser(const Text& text, std::vector<Token> toks) : text_(text), toks_(std::move(toks)) {}

  const Token& peek() const { return toks_[i_]; }
  const Token& take() { return toks_[i_++]; }

  FilterNode or_expr() { return chain(kFilterNodeOr, "OR", &Parser::and_expr); }

 private:
  const Token& expect(Tok kind, const std::string& what) {
    if (peek().kind != kind) syntax_error("expected " + what + ", found " + describe(peek()), text_, peek().pos);
    return take();
  }

  bool keyword(const char* word) {
    if (peek().kind == Tok::Keyword && peek().text == word) {
      ++i_;
      return true;
    }
    return false;
  }

  FilterNode chain(int64_t kind, const char* word, FilterNode (Parser::*next)()) {
    std::vector<FilterNode> children;
    children.push_back((this->*next)());
    while (keyword(word)) children.push_back((this->*next)());
    if (children.size() == 1) return std::move(children[0]);
    FilterNode node;
    node.kind = kind;
    node.children = std::move(children);
    return node;
  }

  FilterNode and_expr() { return chain(kFilterNodeAnd, "AND", &Parser::not_expr); }

  FilterNode not_expr() {
    if (keyword("NOT")) return negate(not_expr());
    return primary();
  }

  static FilterNode negate(FilterNode child) {
    FilterNode node;
    node.kind = kFilterNodeNot;
    node.children.push_back(std::move(child));
    return node;
  }

  static FilterNode term(const Token& name, std::vector<std::string> values) {
    FilterNode node;
    node.kind = kFilterNodeTerm;
    node.feature = name.text;
    node.position = int64_t(name.pos);
    node.values = std::move(values);
    return node;
  }

  FilterNode primary() {
    const Token tok = peek();
    if (tok.kind == Tok::LParen) {
      take();
      FilterNode node = or_expr();
      expect(Tok::RParen, "')'");
      return node;
    }
    if (tok.kind != Tok::Name && tok.kind != Tok::String)
      syntax_error("expected a feature name, NOT or '(', found " + describe(tok), text_, tok.pos);
    const Token name = take();
    const Token op = peek();
    if (op.kind == Tok::Eq) {
      take();
      return term(name, {value()});
    }
    if (op.kind == Tok::Ne) {
      take();
      return negate(term(name, {value()}));
    }
    if (keyword("IN")) return term(name, value_list());
    if (op.kind == Tok::Keyword && op.text == "NOT") {
      take();
      if (!keyword("IN")) syntax_error("expected IN after NOT, found " + describe(peek()), text_, peek().pos);
      return negate(term(name, value_list()));
    }
    syntax_error("expected '=', '!=' or IN after feature " + py_repr(name.text) + ", found " + describe(op), text_,
                 op.pos);
  }

  std::string value() {
    const Token& tok = peek();
    if (tok.kind == Tok::Name || tok.kind == Tok::String) return take().text;
    if (tok.kind == Tok::Keyword)
      syntax_error("expected a value, found keyword " + tok.text + " (quote it to use it as a value)", text_, tok.pos);
    syntax_error("expected a value, found " + describe(tok), text_, tok.pos);
  }

  std::vector<std::string> value_list() {
    expect(Tok::LParen, "'(' after IN");
    std::vector<std::string> values{value()};
    while (peek().kind == Tok::Comma) {
      take();
      values.push_back(value());
    }
    expect(Tok::RParen, "',' or ')' in the IN list");
    std::vector<std::string> unique;  // de-duplicated, order kept
    for (std::string& v : values)
      if (std::find(unique.begin(), unique.end(), v) == unique.end()) unique.push_back(std::move(v));
    return unique;
  }

  const Text& text_;
  std::vector<Token> toks_;
  size_t i_ = 0;
};

// ------------------------------------------------------------------------------------------------ BLAKE2b
// RFC 7693, keyed, with a salt: what Python's hashlib.blake2b(data, digest_size=64, key=, salt=) computes.
constexpr uint64_t kIV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                             0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                             0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

uint64_t load64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

void compress(uint64_t h[8], const uint8_t block[128], uint64_t bytes, bool last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  for (int i = 0; i < 8; ++i) v[i] = h[i], v[i + 8] = kIV[i];
  v[12] ^= bytes;  // the byte counter's low word (the inputs here are far below 2^64 bytes)
  if (last) v[14] = ~v[14];
  auto g = [&](int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x, v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d], v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y, v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d], v[b] = rotr(v[b] ^ v[c], 63);
  };
  for (const auto& s : kSigma) {
    g(0, 4, 8, 12, m[s[0]], m[s[1]]), g(1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(2, 6, 10, 14, m[s[4]], m[s[5]]), g(3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(0, 5, 10, 15, m[s[8]], m[s[9]]), g(1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(2, 7, 8, 13, m[s[12]], m[s[13]]), g(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

// blake2b(data, digest_size=64, key=key (8 bytes), salt=salt (16 bytes)) -> 64 bytes.
std::array<uint8_t, 64> blake2b(const std::string& data, const uint8_t key[8], const uint8_t salt[16]) {
  uint8_t param[64] = {64, 8, 1, 1};  // digest length, key length, fanout, depth; salt at 32
  std::memcpy(param + 32, salt, 16);
  uint64_t h[8];
  for (int i = 0; i < 8; ++i) h[i] = kIV[i] ^ load64(param + 8 * i);
  uint8_t block[128] = {};
  std::memcpy(block, key, 8);  // the key, padded, is the first block
  uint64_t done = 128;
  if (data.empty()) {
    compress(h, block, done, true);
  } else {
    compress(h, block, done, false);
    size_t at = 0;
    while (at < data.size()) {
      const size_t n = std::min<size_t>(128, data.size() - at);
      std::memset(block, 0, sizeof block);
      std::memcpy(block, data.data() + at, n);
      at += n;
      done += n;
      compress(h, block, done, at == data.size());
    }
  }
  std::array<uint8_t, 64> out;
  for (int i = 0; i < 64; ++i) out[size_t(i)] = uint8_t(h[i / 8] >> (8 * (i % 8)));
  return out;
}

// ------------------------------------------------------------------------------------------------ lowering
using Instructions = std::vector<std::pair<int64_t, std::vector<int64_t>>>;

const CompiledFilter& true_program() {
  static const CompiledFilter p = [] {
    CompiledFilter t;
    t.bloom = t.verify = {{kOpTrue, {}}};
    return t;
  }();
  return p;
}

}  // namespace

// ------------------------------------------------------------------------------------------------ public parts
FilterNode parse_filter(const std::string& text) {
  const Text t(text);
  if (int64_t(t.size()) > kFilterMaxLength) {
    const Text head(t.sub(0, 80));
    syntax_error("filter is longer than " + std::to_string(kFilterMaxLength) + " characters", head, 0);
  }
  Parser parser(t, tokenize(t));
  if (parser.peek().kind == Tok::End) syntax_error("empty filter", t, 0);
  FilterNode node = parser.or_expr();
  if (parser.peek().kind != Tok::End)
    syntax_error("expected AND, OR or the end of the filter, found " + describe(parser.peek()), t, parser.peek().pos);
  return node;
}

void flatten_filter(const FilterNode& node, std::vector<int64_t>& nodes, std::vector<std::string>& strings) {
  const bool term = node.kind == kFilterNodeTerm;
  nodes.insert(nodes.end(), {node.kind, int64_t(term ? node.values.size() : node.children.size()), node.position});
  if (term) {
    strings.push_back(node.feature);
    strings.insert(strings.end(), node.values.begin(), node.values.end());
  }
  for (const FilterNode& c : node.children) flatten_filter(c, nodes, strings);
}

namespace {
FilterNode unflatten_at(const std::vector<int64_t>& nodes, const std::vector<std::string>& strings, size_t& n, size_t& s) {
  TORCH_CHECK_VALUE(n + 3 <= nodes.size(), "filter AST: truncated node list");
  FilterNode node;
  node.kind = nodes[n];
  const int64_t count = nodes[n + 1];
  node.position = nodes[n + 2];
  n += 3;
  TORCH_CHECK_VALUE(node.kind >= kFilterNodeTerm && node.kind <= kFilterNodeOr && count >= 0, "filter AST: bad node");
  if (node.kind == kFilterNodeTerm) {
    TORCH_CHECK_VALUE(s + 1 + size_t(count) <= strings.size(), "filter AST: truncated strings");
    node.feature = strings[s++];
    node.values.assign(strings.begin() + s, strings.begin() + s + count);
    s += size_t(count);
  } else {
    TORCH_CHECK_VALUE(node.kind != kFilterNodeNot || count == 1, "filter AST: NOT takes one child");
    for (int64_t i = 0; i < count; ++i) node.children.push_back(unflatten_at(nodes, strings, n, s));
  }
  return node;
}
}  // namespace

FilterNode unflatten_filter(const std::vector<int64_t>& nodes, const std::vector<std::string>& strings) {
  size_t n = 0, s = 0;
  FilterNode node = unflatten_at(nodes, strings, n, s);
  TORCH_CHECK_VALUE(n == nodes.size() && s == strings.size(), "filter AST: trailing nodes or strings");
  return node;
}

std::vector<int64_t> token_positions(const std::string& feature, const std::string& value, int64_t bits, int64_t hashes,
                                     uint64_t seed) {
  if (bits <= 0 || hashes <= 0)
    throw std::invalid_argument("Bloom bits and hashes must be positive, got M=" + std::to_string(bits) +
                                ", K=" + std::to_string(hashes));
  // the token: the feature name's UTF-8 length (u32 little-endian), the name, then the value
  std::string data(4, '\0');
  for (int i = 0; i < 4; ++i) data[size_t(i)] = char((feature.size() >> (8 * i)) & 0xff);
  data += feature + value;
  uint8_t key[8], salt[16] = {};
  for (int i = 0; i < 8; ++i) key[i] = uint8_t(seed >> (8 * i));
  std::vector<int64_t> out;
  for (uint64_t block = 0; int64_t(out.size()) < hashes; ++block) {
    for (int i = 0; i < 8; ++i) salt[i] = uint8_t(block >> (8 * i));
    const auto digest = blake2b(data, key, salt);
    for (int j = 0; j < 16 && int64_t(out.size()) < hashes; ++j) {
      const uint32_t word = uint32_t(digest[size_t(4 * j)]) | uint32_t(digest[size_t(4 * j + 1)]) << 8 |
                            uint32_t(digest[size_t(4 * j + 2)]) << 16 | uint32_t(digest[size_t(4 * j + 3)]) << 24;
      out.push_back(int64_t(uint64_t(word) % uint64_t(bits)));
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ FilterCompiler
// The intermediate form: PUSH rows | FALSE | TRUE | NOT a | AND a b | OR a b (kernels/constants.py opcodes).
struct FilterCompiler::IR {
  int64_t op;
  std::vector<int64_t> rows;
  std::shared_ptr<IR> a, b;
};

namespace {
using IRPtr = std::shared_ptr<FilterCompiler::IR>;

IRPtr make(int64_t op, std::vector<int64_t> rows = {}, IRPtr a = nullptr, IRPtr b = nullptr) {
  return std::make_shared<FilterCompiler::IR>(FilterCompiler::IR{op, std::move(rows), std::move(a), std::move(b)});
}

// Fold a list with a binary op as a balanced tree (shallow stacks), with constant folding.
IRPtr balanced(int64_t op, std::vector<IRPtr> items) {
  const int64_t absorbing = op == kOpAnd ? kOpFalse : kOpTrue, neutral = op == kOpAnd ? kOpTrue : kOpFalse;
  items.erase(std::remove_if(items.begin(), items.end(), [&](const IRPtr& x) { return x->op == neutral; }), items.end());
  if (std::any_of(items.begin(), items.end(), [&](const IRPtr& x) { return x->op == absorbing; })) return make(absorbing);
  if (items.empty()) return make(neutral);
  while (items.size() > 1) {
    std::vector<IRPtr> next;
    for (size_t i = 0; i + 1 < items.size(); i += 2) next.push_back(make(op, {}, items[i], items[i + 1]));
    if (items.size() % 2) next.push_back(items.back());
    items = std::move(next);
  }
  return items[0];
}

IRPtr negate(const IRPtr& x) {
  if (x->op == kOpTrue) return make(kOpFalse);
  if (x->op == kOpFalse) return make(kOpTrue);
  if (x->op == kOpNot) return x->a;
  return make(kOpNot, {}, x);
}

void emit(const IRPtr& x, Instructions& out) {
  if (x->op == kOpNot) {
    emit(x->a, out);
  } else if (x->op == kOpAnd || x->op == kOpOr) {
    emit(x->a, out);
    emit(x->b, out);
  }
  out.emplace_back(x->op, x->op == kOpPush ? x->rows : std::vector<int64_t>{});
}
}  // namespace

FilterCompiler::FilterCompiler(int64_t bloom_bits, int64_t bloom_hashes, int64_t seed, int64_t total_rows,
                               int64_t num_items, std::vector<std::string> names, std::vector<int64_t> value_counts,
                               std::vector<std::string> values, std::vector<int64_t> exact, std::vector<int64_t> postings,
                               std::vector<int64_t> counts, std::vector<int64_t> planes)
    : bits_(bloom_bits), hashes_(bloom_hashes), total_rows_(total_rows), num_items_(num_items), seed_(uint64_t(seed)),
      names_(std::move(names)) {
  const size_t F = names_.size();
  TORCH_CHECK_VALUE(value_counts.size() == F && exact.size() == 3 * F, "FilterCompiler: one value count and one "
                    "(row, slots, bits) per feature");
  size_t at = 0;
  for (size_t f = 0; f < F; ++f) {
    const size_t n = size_t(value_counts[f]);
    TORCH_CHECK_VALUE(at + n <= values.size() && at + n <= postings.size() && at + n <= counts.size() &&
                          at + n <= planes.size(), "FilterCompiler: per value a posting list, a count and a plane");
    std::unordered_map<std::string, int64_t> index;
    for (size_t i = 0; i < n; ++i) index.emplace(values[at + i], int64_t(i));
    vocab_.push_back(std::move(index));
    postings_.emplace_back(postings.begin() + at, postings.begin() + at + n);
    counts_.emplace_back(counts.begin() + at, counts.begin() + at + n);
    planes_.emplace_back(planes.begin() + at, planes.begin() + at + n);
    exact_.push_back({exact[3 * f], exact[3 * f + 1], exact[3 * f + 2]});
    name_index_.emplace(names_[f], int64_t(f));
    at += n;
  }
}

int64_t FilterCompiler::feature_index(const std::string& name) const {
  const auto it = name_index_.find(name);
  return it == name_index_.end() ? -1 : it->second;
}

std::shared_ptr<FilterCompiler::IR> FilterCompiler::lower(const FilterNode& node, bool negated, bool exact_positive) const {
  if (node.kind == kFilterNodeTerm) {
    const int64_t f = feature_index(node.feature);
    if (f < 0)
      throw RequestError("unknown feature " + py_repr(node.feature) + " in filter at position " +
                         std::to_string(node.position) + "; this snapshot can filter on " +
                         (names_.empty() ? std::string("no features") : py_list_repr(names_)));
    std::vector<IRPtr> pushes;
    const auto& [row0, slots, nbits] = exact_[size_t(f)];
    for (const std::string& v : node.values) {
      const auto it = vocab_[size_t(f)].find(v);
      if (it == vocab_[size_t(f)].end()) continue;  // outside the vocabulary: matches nothing
      const int64_t plane = planes_[size_t(f)][size_t(it->second)];
      if (plane >= 0) {  // the value's own bit plane: one exact row
        pushes.push_back(make(kOpPush, {plane}));
      } else if ((negated || exact_positive) && row0 >= 0) {  // per slot: the code's bits, exactly
        const int64_t code = it->second + 1;
        for (int64_t s = 0; s < slots; ++s) {
          std::vector<int64_t> rows;
          for (int64_t b = 0; b < nbits; ++b) {
            const int64_t r = row0 + s * nbits + b;
            rows.push_back((code >> b) & 1 ? r : ~r);
          }
          pushes.push_back(make(kOpPush, std::move(rows)));
        }
      } else {
        pushes.push_back(make(kOpPush, token_positions(node.feature, v, bits_, hashes_, seed_)));
      }
    }
    return balanced(kOpOr, std::move(pushes));
  }
  if (node.kind == kFilterNodeNot) return negate(lower(node.children[0], !negated, exact_positive));
  std::vector<IRPtr> parts;
  for (const FilterNode& c : node.children) parts.push_back(lower(c, negated, exact_positive));
  return balanced(node.kind == kFilterNodeAnd ? kOpAnd : kOpOr, std::move(parts));
}

std::optional<std::pair<std::vector<int64_t>, int64_t>> FilterCompiler::posting_lists(const FilterNode& node) const {
  using Lists = std::optional<std::pair<std::vector<int64_t>, int64_t>>;
  if (node.kind == kFilterNodeTerm) {  // its values' lists (values outside the vocabulary need none)
    const int64_t f = feature_index(node.feature);
    if (f < 0) return std::nullopt;
    std::map<int64_t, int64_t> lists;
    for (const std::string& v : node.values) {
      const auto it = vocab_[size_t(f)].find(v);
      if (it != vocab_[size_t(f)].end()) lists[postings_[size_t(f)][size_t(it->second)]] = counts_[size_t(f)][size_t(it->second)];
    }
    if (!lists.empty() && lists.begin()->first < 0) return std::nullopt;  // a value too frequent for a list
    std::pair<std::vector<int64_t>, int64_t> out{{}, 0};
    for (const auto& [id, n] : lists) out.first.push_back(id), out.second += n;
    return out;
  }
  if (node.kind == kFilterNodeNot) {  // NOT NOT x is x; any other NOT has no superset
    const FilterNode& child = node.children[0];
    return child.kind == kFilterNodeNot ? posting_lists(child.children[0]) : Lists();
  }
  std::vector<Lists> parts;
  for (const FilterNode& c : node.children) parts.push_back(posting_lists(c));
  if (node.kind == kFilterNodeAnd) {  // the cheapest child (the first of equals)
    Lists best;
    for (Lists& p : parts)
      if (p && (!best || p->second < best->second)) best = std::move(p);
    return best;
  }
  std::set<int64_t> ids;  // OR: every child's lists united (the total: an upper bound when children share lists)
  int64_t total = 0;
  for (const Lists& p : parts) {
    if (!p) return std::nullopt;
    ids.insert(p->first.begin(), p->first.end());
    total += p->second;
  }
  return std::make_pair(std::vector<int64_t>(ids.begin(), ids.end()), total);
}

double FilterCompiler::estimate(const FilterNode& node) const {
  // items passing, from the per-value counts with independent features: a term sums its values' counts, NOT is the
  // complement, AND multiplies fractions, OR is 1 - the product of the complements
  const double n = double(std::max<int64_t>(num_items_, 1));
  if (node.kind == kFilterNodeTerm) {
    const int64_t f = feature_index(node.feature);
    double sum = 0;
    for (const std::string& v : node.values) {
      if (f < 0) break;
      const auto it = vocab_[size_t(f)].find(v);
      if (it != vocab_[size_t(f)].end()) sum += double(counts_[size_t(f)][size_t(it->second)]);
    }
    return std::min(n, sum);
  }
  if (node.kind == kFilterNodeNot) return n - estimate(node.children[0]);
  double product = 1.0;
  for (const FilterNode& c : node.children) {
    const double frac = estimate(c) / n;
    product *= node.kind == kFilterNodeAnd ? frac : 1.0 - frac;
  }
  return node.kind == kFilterNodeAnd ? n * product : n * (1.0 - product);
}

CompiledFilter FilterCompiler::compile(const FilterNode& node) const {
  CompiledFilter p;
  emit(lower(node, false, false), p.bloom);
  emit(lower(node, false, true), p.verify);
  p.lists = posting_lists(node);
  p.estimate = estimate(node);
  return p;
}

std::shared_ptr<const CompiledFilter> FilterCompiler::compile(const std::string& text, bool use_cache) const {
  if (!use_cache) return std::make_shared<const CompiledFilter>(compile(parse_filter(text)));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = cached_.find(text);
    if (it != cached_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  auto program = std::make_shared<const CompiledFilter>(compile(parse_filter(text)));
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cached_.count(text)) {
    lru_.emplace_front(text, program);
    cached_[text] = lru_.begin();
    if (lru_.size() > kProgramCacheSize) {
      cached_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }
  return program;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> FilterCompiler::program_tensors(const Instructions& prog) {
  const int64_t L = int64_t(prog.size());
  int64_t T = 1;
  for (const auto& [op, rows] : prog) T = std::max(T, int64_t(rows.size()));
  at::Tensor ops = at::empty({L}, at::kLong), rows = at::zeros({L, T}, at::kLong), widths = at::empty({L}, at::kLong);
  for (int64_t l = 0; l < L; ++l) {
    const auto& [op, r] = prog[size_t(l)];
    ops.data_ptr<int64_t>()[l] = op;
    widths.data_ptr<int64_t>()[l] = int64_t(r.size());
    int64_t* dst = rows.data_ptr<int64_t>() + l * T;
    for (int64_t t = 0; t < T && !r.empty(); ++t) dst[t] = t < int64_t(r.size()) ? r[size_t(t)] : r[0];
  }
  return {ops, rows, widths};
}

RequestPrograms FilterCompiler::request(const std::vector<std::optional<std::string>>& filters, bool use_cache) const {
  TORCH_CHECK_VALUE(!filters.empty(), "no filters to compile");
  std::vector<std::shared_ptr<const CompiledFilter>> programs;
  for (const auto& f : filters)
    programs.push_back(f ? compile(*f, use_cache) : std::shared_ptr<const CompiledFilter>(&true_program(), [](const CompiledFilter*) {}));
  const int64_t B = int64_t(filters.size());
  auto pad = [&](bool verify, at::Tensor& ops_t, at::Tensor& rows_t) {
    int64_t L = 1, T = 1;
    for (const auto& p : programs) {
      const Instructions& prog = verify ? p->verify : p->bloom;
      L = std::max(L, int64_t(prog.size()));
      for (const auto& ins : prog) T = std::max(T, int64_t(ins.second.size()));
    }
    ops_t = at::zeros({B, L}, at::kLong);  // NOP padding
    rows_t = at::zeros({B, L, T}, at::kLong);
    int64_t *ops = ops_t.data_ptr<int64_t>(), *rows = rows_t.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const Instructions& prog = verify ? programs[size_t(b)]->verify : programs[size_t(b)]->bloom;
      for (size_t l = 0; l < prog.size(); ++l) {
        const auto& [op, r] = prog[l];
        ops[b * L + int64_t(l)] = op;
        for (int64_t t = 0; t < T && !r.empty(); ++t)  // PUSH operands padded by their first row (AND: idempotent)
          rows[(b * L + int64_t(l)) * T + t] = t < int64_t(r.size()) ? r[size_t(t)] : r[0];
      }
    }
  };
  RequestPrograms out;
  pad(false, out.ops, out.rows);
  pad(true, out.vops, out.vrows);
  int64_t W = 1;  // the posting lists: -1 padded; NO_LISTS in column 0 for no filter or no superset
  for (size_t b = 0; b < filters.size(); ++b)
    if (filters[b] && programs[b]->lists) W = std::max(W, int64_t(programs[b]->lists->first.size()));
  out.lists = at::full({B, W}, kNoList, at::kLong);
  int64_t* lists = out.lists.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const CompiledFilter& p = *programs[size_t(b)];
    if (!filters[size_t(b)] || !p.lists) lists[b * W] = kNoLists;
    else std::copy(p.lists->first.begin(), p.lists->first.end(), lists + b * W);
  }
  return out;
}

std::vector<double> FilterCompiler::estimates(const std::vector<std::optional<std::string>>& filters) const {
  std::vector<double> out;
  for (const auto& f : filters) {
    if (!f) {
      out.push_back(double(std::max<int64_t>(num_items_, 1)));
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = cached_.find(*f);
      if (it != cached_.end()) {
        out.push_back(it->second->second->estimate);
        continue;
      }
    }
    out.push_back(estimate(parse_filter(*f)));  // no compile: an unknown feature estimates 0, not an error
  }
  return out;
}

}  // namespace silverrec
