// Loading and verifying a snapshot (snapshot.h).
#include "snapshot.h"

#include <dlfcn.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <torch/serialize.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <vector>

#ifndef SILVERREC_FORMAT_VERSION
#error "SILVERREC_FORMAT_VERSION comes from silverrec/snapshot.py (predictor/CMakeLists.txt)"
#endif

namespace silverrec {

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kScriptFile = "model.ts";
constexpr const char* kTensorsFile = "tensors.pt";
// Python's json writes NaN, Infinity and -Infinity (a report's values), which JSON has not: each becomes the string
// "\u0000" + its name (python_dumps writes the name back, so the manifest's digest is Python's).
constexpr const char* kNonFinite[] = {"-Infinity", "Infinity", "NaN"};

std::string join(const std::string& root, const std::string& name) { return root + "/" + name; }

bool is_dir(const std::string& p) {
  struct stat s;
  return ::stat(p.c_str(), &s) == 0 && S_ISDIR(s.st_mode);
}

bool is_file(const std::string& p) {
  struct stat s;
  return ::stat(p.c_str(), &s) == 0 && S_ISREG(s.st_mode);
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SnapshotError("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string hex(const unsigned char* d, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    out += digits[d[i] >> 4];
    out += digits[d[i] & 15];
  }
  return out;
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SnapshotError("cannot read " + path);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  std::vector<char> block(1 << 20);
  while (in) {
    in.read(block.data(), std::streamsize(block.size()));
    EVP_DigestUpdate(ctx, block.data(), size_t(in.gcount()));
  }
  unsigned char digest[32];
  unsigned int n = 0;
  EVP_DigestFinal_ex(ctx, digest, &n);
  EVP_MD_CTX_free(ctx);
  return hex(digest, n);
}

std::string sha256_text(const std::string& text) {
  unsigned char digest[32];
  unsigned int n = 0;
  EVP_Digest(text.data(), text.size(), digest, &n, EVP_sha256(), nullptr);
  return hex(digest, n);
}

// root as Python's Path(root) prints it: no trailing slashes
std::string clean(std::string root) {
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return root;
}

std::string major_minor(const std::string& v) {
  const std::string base = v.substr(0, v.find('+'));
  const size_t first = base.find('.');
  if (first == std::string::npos) return base;
  return base.substr(0, base.find('.', first + 1));
}

void python_float(double x, std::string& out) {
  if (std::isnan(x)) {
    out += "NaN";
    return;
  }
  if (std::isinf(x)) {
    out += x > 0 ? "Infinity" : "-Infinity";
    return;
  }
  char buf[64];
  int p = 1;
  for (; p <= 17; ++p) {  // the shortest digits that read back as x (repr's)
    std::snprintf(buf, sizeof buf, "%.*e", p - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  // buf: [-]d.ddde[+-]XX -> digits and the decimal exponent of the first digit
  std::string s(buf), digits;
  const bool neg = s[0] == '-';
  const size_t e = s.find('e');
  for (size_t i = neg ? 1 : 0; i < e; ++i)
    if (s[i] != '.') digits += s[i];
  const int exp10 = std::atoi(s.c_str() + e + 1);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  if (neg) out += '-';
  if (exp10 < -4 || exp10 >= 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    std::snprintf(buf, sizeof buf, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += buf;
  } else if (exp10 < 0) {
    out += "0." + std::string(size_t(-exp10 - 1), '0') + digits;
  } else if (size_t(exp10) + 1 >= digits.size()) {
    out += digits + std::string(size_t(exp10) + 1 - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, size_t(exp10) + 1) + "." + digits.substr(size_t(exp10) + 1);
  }
}

void python_string(const std::string& s, std::string& out) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    uint32_t cp = c;
    size_t n = 1;
    if (c >= 0xf0) cp = c & 0x07, n = 4;
    else if (c >= 0xe0) cp = c & 0x0f, n = 3;
    else if (c >= 0xc0) cp = c & 0x1f, n = 2;
    for (size_t j = 1; j < n && i + j < s.size(); ++j) cp = (cp << 6) | (uint32_t(s[i + j]) & 0x3f);
    i += n;
    char buf[16];
    switch (cp) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (cp < 0x20 || (cp >= 0x7f && cp < 0x10000)) {
          std::snprintf(buf, sizeof buf, "\\u%04x", cp);
          out += buf;
        } else if (cp >= 0x10000) {
          cp -= 0x10000;
          std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
          out += buf;
        } else out += char(cp);
    }
  }
  out += '"';
}

void python_dumps(const Json& v, std::string& out) {
  switch (v.type()) {
    case Json::value_t::null: out += "null"; break;
    case Json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; break;
    case Json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); break;
    case Json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); break;
    case Json::value_t::number_float: python_float(v.get<double>(), out); break;
    case Json::value_t::string: {
      const std::string& text = v.get_ref<const std::string&>();
      if (!text.empty() && text[0] == '\0' && std::find(std::begin(kNonFinite), std::end(kNonFinite), text.substr(1)) !=
                                                  std::end(kNonFinite))
        out += text.substr(1);  // a non-finite float (python_json_text)
      else
        python_string(text, out);
      break;
    }
    case Json::value_t::array: {
      out += '[';
      bool first = true;
      for (const Json& x : v) {
        if (!first) out += ", ";
        first = false;
        python_dumps(x, out);
      }
      out += ']';
      break;
    }
    case Json::value_t::object: {  // nlohmann's object is a std::map: sorted by key, as sort_keys
      out += '{';
      bool first = true;
      for (const auto& [key, x] : v.items()) {
        if (!first) out += ", ";
        first = false;
        python_string(key, out);
        out += ": ";
        python_dumps(x, out);
      }
      out += '}';
      break;
    }
    default: throw SnapshotError("manifest holds a value JSON cannot");
  }
}

// ---- .npz: a zip of .npy files, stored (np.savez), with zip64 records
uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

at::Tensor parse_npy(const unsigned char* p, size_t size, const std::string& where) {
  if (size < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) throw SnapshotError(where + " is not a .npy array");
  const int major = p[6];
  const size_t hlen = major == 1 ? le(p + 8, 2) : le(p + 8, 4), start = major == 1 ? 10 : 12;
  const std::string header(reinterpret_cast<const char*>(p + start), hlen);
  auto field = [&](const std::string& key) {
    const size_t k = header.find("'" + key + "'");
    if (k == std::string::npos) throw SnapshotError(where + ": .npy header without " + key);
    return header.substr(header.find(':', k) + 1);
  };
  const std::string descr_field = field("descr"), shape = field("shape"), order = field("fortran_order");
  const size_t q = descr_field.find('\'');
  const std::string descr = descr_field.substr(q + 1, descr_field.find('\'', q + 1) - q - 1);
  if (order.find("True") < order.find(',')) throw SnapshotError(where + ": Fortran order");
  at::ScalarType dtype;
  size_t item;
  if (descr == "<i8") dtype = at::kLong, item = 8;
  else if (descr == "<i4") dtype = at::kInt, item = 4;
  else if (descr == "<f4") dtype = at::kFloat, item = 4;
  else if (descr == "<f8") dtype = at::kDouble, item = 8;
  else if (descr == "|b1") dtype = at::kBool, item = 1;
  else throw SnapshotError(where + ": unsupported dtype " + descr);
  std::vector<int64_t> dims;
  const std::string inner = shape.substr(shape.find('(') + 1, shape.find(')') - shape.find('(') - 1);
  std::stringstream ss(inner);
  for (std::string part; std::getline(ss, part, ',');)
    if (part.find_first_of("0123456789") != std::string::npos) dims.push_back(std::stoll(part));
  int64_t numel = 1;
  for (int64_t d : dims) numel *= d;
  if (start + hlen + size_t(numel) * item > size) throw SnapshotError(where + ": truncated array");
  at::Tensor t = at::empty(dims, at::TensorOptions().dtype(dtype));
  std::memcpy(t.data_ptr(), p + start + hlen, size_t(numel) * item);
  return t;
}


std::string python_json_text(const std::vector<char>& raw) {
  const std::string text(raw.begin(), raw.end());
  std::string out;
  bool quoted = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) out += text[++i];
      else if (c == '"') quoted = false;
      continue;
    }
    if (c == '"') quoted = true;
    bool replaced = false;
    for (const char* name : kNonFinite)
      if (text.compare(i, std::strlen(name), name) == 0) {
        out += std::string("\"\\u0000") + name + "\"";
        i += std::strlen(name) - 1;
        replaced = true;
        break;
      }
    if (!replaced) out += c;
  }
  return out;
}

}  // namespace

std::map<std::string, at::Tensor> read_npz(const std::string& path) {
  const std::vector<char> raw = read_bytes(path);
  const auto* d = reinterpret_cast<const unsigned char*>(raw.data());
  const size_t n = raw.size();
  size_t eocd = std::string::npos;
  for (size_t i = n >= 22 ? n - 22 : 0; i + 1 > 0 && i + 65557 >= n; --i) {
    if (le(d + i, 4) == 0x06054b50) {
      eocd = i;
      break;
    }
    if (i == 0) break;
  }
  if (eocd == std::string::npos) throw SnapshotError(path + " is not a zip (.npz) file");
  uint64_t entries = le(d + eocd + 10, 2), cd = le(d + eocd + 16, 4);
  if ((entries == 0xffff || cd == 0xffffffff) && eocd >= 20 && le(d + eocd - 20, 4) == 0x07064b50) {
    const uint64_t z64 = le(d + eocd - 20 + 8, 8);
    entries = le(d + z64 + 32, 8);
    cd = le(d + z64 + 48, 8);
  }
  std::map<std::string, at::Tensor> out;
  size_t at_ = size_t(cd);
  for (uint64_t e = 0; e < entries; ++e) {
    if (at_ + 46 > n || le(d + at_, 4) != 0x02014b50) throw SnapshotError(path + ": bad zip directory");
    const int method = int(le(d + at_ + 10, 2));
    uint64_t size = le(d + at_ + 20, 4), local = le(d + at_ + 42, 4);
    const size_t name_len = le(d + at_ + 28, 2), extra_len = le(d + at_ + 30, 2), comment_len = le(d + at_ + 32, 2);
    std::string name(reinterpret_cast<const char*>(d + at_ + 46), name_len);
    const unsigned char* extra = d + at_ + 46 + name_len;
    for (size_t x = 0; x + 4 <= extra_len;) {  // zip64: the sizes and offset that overflowed 32 bits, in order
      const uint64_t id = le(extra + x, 2), len = le(extra + x + 2, 2);
      if (id == 1) {
        size_t f = x + 4;
        if (le(d + at_ + 24, 4) == 0xffffffff) f += 8;  // uncompressed size
        if (size == 0xffffffff) size = le(extra + f, 8), f += 8;
        if (local == 0xffffffff) local = le(extra + f, 8);
      }
      x += 4 + len;
    }
    if (method != 0) throw SnapshotError(path + ": " + name + " is compressed (np.savez_compressed); expected np.savez");
    const size_t data = size_t(local) + 30 + le(d + local + 26, 2) + le(d + local + 28, 2);
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0) name.resize(name.size() - 4);
    out[name] = parse_npy(d + data, size_t(size), path + ":" + name);
    at_ += 46 + name_len + extra_len + comment_len;
  }
  return out;
}

Json read_manifest(const std::string& root_in, bool verify) {
  const std::string root = clean(root_in);
  if (!is_dir(root)) throw SnapshotError(root + " is not a snapshot directory");
  const std::string mpath = join(root, kManifest);
  if (!is_file(mpath)) throw SnapshotError(root + " has no " + kManifest + ": not a snapshot, or an unfinished write");
  Json manifest;
  try {
    manifest = Json::parse(python_json_text(read_bytes(mpath)));
  } catch (const Json::parse_error& e) {
    throw SnapshotError(mpath + " is not valid JSON (" + e.what() + ")");
  }
  const Json version = manifest.value("format_version", Json());
  if (!version.is_number_integer()) throw SnapshotError(mpath + " has no integer format_version");
  const int64_t v = version.get<int64_t>();
  const std::string ours = SILVERREC_VERSION;
  if (v > SILVERREC_FORMAT_VERSION)
    throw SnapshotError("snapshot " + root + " has format version " + std::to_string(v) + ", written by silverrec " +
                        manifest.value("silverrec_version", std::string("?")) + "; this silverrec " + ours +
                        " reads format versions <= " + std::to_string(SILVERREC_FORMAT_VERSION) + ": upgrade silverrec");
  if (v < SILVERREC_MIN_FORMAT_VERSION)
    throw SnapshotError("snapshot " + root + " has format version " + std::to_string(v) + " (kind '" +
                        manifest.value("kind", std::string("None")) + "'); this silverrec " + ours +
                        " reads format versions " + std::to_string(SILVERREC_MIN_FORMAT_VERSION) + ".." +
                        std::to_string(SILVERREC_FORMAT_VERSION) +
                        ": its program calls operators in a form this silverrec no longer has (format 6: the search "
                        "ops' narrow interface), so re-publish it with this silverrec");
  if (!verify) return manifest;
  const Json files = manifest.value("files", Json::object());
  for (const auto& [name, meta] : files.items()) {
    const std::string p = join(root, name);
    struct stat s;
    if (::stat(p.c_str(), &s) != 0 || !S_ISREG(s.st_mode)) throw SnapshotError("snapshot " + root + " is missing " + name);
    const int64_t want = meta.at("bytes").get<int64_t>();
    if (int64_t(s.st_size) != want)
      throw SnapshotError(p + " is truncated or altered: " + std::to_string(s.st_size) + " bytes, manifest says " +
                          std::to_string(want));
    const std::string digest = sha256_file(p), expected = meta.at("sha256").get<std::string>();
    if (digest != expected)
      throw SnapshotError(p + " checksum mismatch: sha256 " + digest.substr(0, 12) + "..., manifest says " +
                          expected.substr(0, 12) + "...");
  }
  return manifest;
}

void check_build(const Json& manifest, const std::string& root_in) {
  const std::string root = clean(root_in);
  Json built = manifest.value("build", Json::object());
  if (!built.contains("torch") && manifest.contains("torch_version")) built["torch"] = manifest["torch_version"];
  if (!built.contains("silverrec") && manifest.contains("silverrec_version")) built["silverrec"] = manifest["silverrec_version"];
  const std::map<std::string, std::string> here = {{"torch", TORCH_VERSION}, {"silverrec", SILVERREC_VERSION}};
  for (const auto& [pkg, ours] : here) {
    if (!built.contains(pkg) || !built[pkg].is_string()) continue;
    const std::string theirs = built[pkg].get<std::string>();
    if (major_minor(theirs) != major_minor(ours))
      throw SnapshotError("snapshot " + root + " was built with " + pkg + " " + theirs + "; this process has " + pkg +
                          " " + ours + ": " + pkg + " major.minor must match to load its program (checked: torch, "
                          "silverrec). Republish it, or install " + pkg + "==" + theirs);
  }
}

std::string python_json_dumps(const Json& value) {
  std::string out;
  python_dumps(value, out);
  return out;
}

std::string snapshot_version(const Json& manifest, const std::string& root_in) {
  if (manifest.contains("version") && manifest["version"].is_string() && !manifest["version"].get<std::string>().empty())
    return manifest["version"].get<std::string>();
  const std::string root = clean(root_in);
  const std::string name = root.substr(root.find_last_of('/') == std::string::npos ? 0 : root.find_last_of('/') + 1);
  return name + "@" + sha256_text(python_json_dumps(manifest)).substr(0, 12);
}

torch::jit::Module load_scripted(const std::string& root_in, const Json& manifest) {
  const std::string root = clean(root_in);
  const Json files = manifest.value("files", Json::object());
  if (!files.contains(kScriptFile))
    throw SnapshotError("snapshot " + root + " has no TorchScript file (" + kScriptFile + ")");
  torch::jit::Module module;
  try {
    module = torch::jit::load(join(root, kScriptFile));
  } catch (const c10::Error& e) {
    throw SnapshotError("cannot load torchscript program from " + root + ": " + e.what_without_backtrace());
  }
  module.eval();
  if (!files.contains(kTensorsFile)) return module;
  const c10::IValue state = torch::pickle_load(read_bytes(join(root, kTensorsFile)));
  for (const auto& entry : state.toGenericDict()) {  // each stored tensor in place of its placeholder
    const std::string name = entry.key().toStringRef();
    const at::Tensor t = entry.value().toTensor();
    torch::jit::Module owner = module;
    std::string leaf = name;
    for (size_t dot; (dot = leaf.find('.')) != std::string::npos; leaf = leaf.substr(dot + 1))
      owner = owner.attr(leaf.substr(0, dot)).toModule();
    if (!owner.hasattr(leaf) || !owner.attr(leaf).isTensor() || owner.attr(leaf).toTensor().sizes() != t.sizes() ||
        owner.attr(leaf).toTensor().scalar_type() != t.scalar_type())
      throw SnapshotError(join(root, kTensorsFile) + ": tensor '" + name + "' does not match the program's placeholder");
    owner.setattr(leaf, t);
  }
  return module;
}

void load_program_libraries(const Json& manifest) {
  const Json config = manifest.value("config", Json::object());
  const std::string tower = config.value("spec", Json::object()).value("tower", std::string());
  if (manifest.value("kind", std::string()) != "rec" || tower != "two_tower") return;  // snapshot.py needs_torchrec
  // silverrec's own user tower: TorchRec's embedding bags, whose ops fbgemm_gpu defines (in its import order)
  static const char* libraries[] = {"fbgemm_gpu_config", "fbgemm_gpu_tbe_utils", "fbgemm_gpu_tbe_index_select",
                                    "fbgemm_gpu_tbe_cache", "fbgemm_gpu_tbe_optimizers", "fbgemm_gpu_tbe_inference",
                                    "fbgemm_gpu_tbe_training_forward", "fbgemm_gpu_tbe_training_backward",
                                    "fbgemm_gpu_tbe_training_backward_pt2", "fbgemm_gpu_tbe_training_backward_dense",
                                    "fbgemm_gpu_tbe_training_backward_split_host",
                                    "fbgemm_gpu_tbe_training_backward_gwd", "fbgemm_gpu_tbe_training_backward_vbe",
                                    "fbgemm_gpu_py"};
  static bool loaded = false;
  if (loaded) return;
  const char* env = std::getenv("SILVERREC_FBGEMM_DIR");
  const std::string dir = env ? env : SILVERREC_FBGEMM_DIR;
  for (const char* lib : libraries) {
    const std::string p = dir + "/" + lib + ".so";
    if (!dlopen(p.c_str(), RTLD_NOW | RTLD_GLOBAL))
      throw SnapshotError(std::string("this snapshot's user tower needs fbgemm_gpu's operators: cannot load ") + p + ": " +
                          dlerror() + " (set SILVERREC_FBGEMM_DIR to the fbgemm_gpu package directory)");
  }
  loaded = true;
}

}  // namespace silverrec
