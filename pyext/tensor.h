// Binding helpers: read a torch tensor through its Python attributes (no libtorch link), check
// it, and hand raw pointers to the core. Every binding validates shapes, dtypes and devices
// here so that the kernels in csrc/ can trust their arguments.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // every binding file sees the same casters (one definition rule)

#include <cuda_runtime.h>

#include "../csrc/common.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nanograph::py_ext {

namespace py = pybind11;

// Errors are raised through nanograph::throw_invalid_argument / throw_type_error (csrc/common.h)
// and never as pybind11's own exception types: those crash next to torch's copy of pybind11.
using ::nanograph::throw_invalid_argument;
using ::nanograph::throw_type_error;

struct Tensor {
  std::string name;
  void* ptr = nullptr;
  std::vector<int64_t> shape;
  std::string dtype;  // "bfloat16", "float32", "int32", ...
  int device = -1;    // CUDA device index

  int dim() const { return static_cast<int>(shape.size()); }
  int64_t size(int i) const { return shape.at(i < 0 ? i + dim() : i); }
  int64_t numel() const;
  template <class T>
  T* data() const { return static_cast<T*>(ptr); }
};

// Reads `obj` (a torch.Tensor) and requires it to be a contiguous CUDA tensor of `dtype`.
Tensor cuda_tensor(py::handle obj, const char* name, const char* dtype);

// Same, but None gives a Tensor with ptr == nullptr.
Tensor optional_cuda_tensor(py::handle obj, const char* name, const char* dtype);

// Requires t.shape == expected, where -1 matches any size. The error names the tensor.
void expect_shape(const Tensor& t, const std::vector<int64_t>& expected);

// Requires all tensors to live on the same device; returns it and makes it current.
int same_device(const std::vector<const Tensor*>& tensors);

// value as an int, or an error naming `what` when it exceeds what the kernels take.
int checked_int(int64_t value, const std::string& what);

// Logits [rows, vocab] of `dtype`, which may be a row slice of a wider buffer ([rows, vocab] out
// of [rows, padded]): only the last dimension must be contiguous. Returns the tensor and its row
// stride in elements.
std::pair<Tensor, int64_t> row_strided_logits(py::object logits, const char* dtype = "bfloat16");

// host_out's address for the GPU: None gives nullptr; otherwise it must be a contiguous pinned
// CPU int32 tensor of `rows` elements whose memory is mapped (torch's pin_memory=True).
int32_t* mapped_host_ids(py::object host_out, int64_t rows, const char* op);

// The stream torch is using on the current device, so results are ordered with torch's work.
cudaStream_t torch_current_stream();

using Binder = void (*)(py::module_&);
int register_binder(Binder binder);
void run_binders(py::module_& m);

}  // namespace nanograph::py_ext

// Defines a function that adds bindings to the module; it runs when the module is imported.
#define NANOGRAPH_BINDINGS(fn)                                                  \
  static void fn(pybind11::module_& m);                                        \
  static const int fn##_registered = ::nanograph::py_ext::register_binder(fn); \
  static void fn(pybind11::module_& m)
