// The part of ATen the kernels use: the Tensor class and the few functions they call. Each .cpp
// includes this instead of <ATen/ATen.h> (every op's declaration: ~14 s of compile per file) or
// <torch/extension.h> (the C++ frontend as well: ~38 s); <ATen/core/Tensor.h> takes ~3 s. The
// extension is compiled three times in `make test` (native, and the portable ISAs), so this is most
// of CI's build time. A kernel that calls another at:: function adds its <ATen/ops/NAME.h> here.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
