// jit_forward LIBRARY MODEL INPUTS OUTPUT: dlopen the operator library, load the TorchScript program MODEL,
// call its forward on the arguments pickled in INPUTS (a tuple, as Python's torch.save writes it) and pickle
// what it returns to OUTPUT (torch.load reads it). No Python in the process: every silverrec op the program
// calls must come from LIBRARY (schema and CPU kernel).
#include <dlfcn.h>

#include <torch/script.h>
#include <torch/serialize.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

namespace {

std::vector<char> read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::string("cannot read ") + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A pickled list arrives as List[Any]: a list of tensors becomes Tensor[], as the program's signature wants.
c10::IValue typed(const c10::IValue& v) {
  if (!v.isList()) return v;
  c10::List<at::Tensor> tensors;
  for (const c10::IValue& x : v.toListRef()) {
    if (!x.isTensor()) return v;
    tensors.push_back(x.toTensor());
  }
  return tensors;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: jit_forward LIBRARY MODEL INPUTS OUTPUT\n";
    return 2;
  }
  if (!dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) {
    std::cerr << "dlopen " << argv[1] << ": " << dlerror() << "\n";
    return 3;
  }
  try {
    torch::jit::Module model = torch::jit::load(argv[2]);
    model.eval();
    const c10::IValue inputs = torch::pickle_load(read_file(argv[3]));
    std::vector<c10::IValue> args;
    for (const c10::IValue& v : inputs.toTupleRef().elements()) args.push_back(typed(v));
    c10::InferenceMode guard;
    const c10::IValue out = model.forward(args);
    const std::vector<char> bytes = torch::pickle_save(out);
    std::ofstream(argv[4], std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
