// A snapshot directory as silverrec-predictor loads it: the manifest verified as silverrec/snapshot.py's
// read_manifest and check_build verify it (format version, every file's size and sha256, the torch and silverrec
// that built it; the same messages), the TorchScript program with its state (tensors.pt where stored apart), and the
// side files' arrays (.npz).
#pragma once

#include <nlohmann/json.hpp>
#include <torch/script.h>

#include <map>
#include <stdexcept>
#include <string>

namespace silverrec {

// A snapshot this process cannot run (Python: SnapshotError); the message names the problem.
struct SnapshotError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using Json = nlohmann::json;

// read_manifest: the manifest of the snapshot at `root`, its files verified (sizes, sha256) when `verify`.
Json read_manifest(const std::string& root, bool verify = true);
// check_build: SnapshotError when the torch or silverrec that built the snapshot differs in major.minor.
void check_build(const Json& manifest, const std::string& root);
// The served version: the manifest's "version", else "<directory name>@<sha256 of the sorted-keys JSON>[:12]"
// (silverrec/serving/served.py snapshot_version).
std::string snapshot_version(const Json& manifest, const std::string& root);
// Python's json.dumps(value, sort_keys=True): its separators, ASCII escapes and float repr.
std::string python_json_dumps(const Json& value);

// model.ts as a Module, with tensors.pt's tensors put in place of their placeholders.
torch::jit::Module load_scripted(const std::string& root, const Json& manifest);

// The arrays of an .npz file (np.savez: stored, not compressed) by name; 1-d int64 / int32 / float32 only.
std::map<std::string, at::Tensor> read_npz(const std::string& path);

// A program's ops from their libraries: the silverrec operator library (linked) and, for a snapshot whose program
// holds TorchRec's embedding ops, fbgemm_gpu's libraries (dlopened from SILVERREC_FBGEMM_DIR, else the build's).
void load_program_libraries(const Json& manifest);

}  // namespace silverrec
