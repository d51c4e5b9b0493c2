// Binding helpers: tensor inspection, validation and the torch stream.
#include "tensor.h"

#include <climits>
#include <stdexcept>

namespace nanograph::py_ext {

namespace {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::vector<Binder>& binders() {
  static std::vector<Binder> all;
  return all;
}

}  // namespace

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Tensor cuda_tensor(py::handle obj, const char* name, const char* dtype) {
  if (obj.is_none() || !py::hasattr(obj, "data_ptr")) {
    throw_type_error(std::string(name) + " must be a torch.Tensor");
  }
  Tensor t;
  t.name = name;
  py::object device = obj.attr("device");
  if (device.attr("type").cast<std::string>() != "cuda") {
    throw_invalid_argument(std::string(name) + " must be a CUDA tensor, got device " +
                          py::str(device).cast<std::string>());
  }
  t.device = device.attr("index").cast<int>();
  std::string full_dtype = py::str(obj.attr("dtype")).cast<std::string>();  // "torch.bfloat16"
  t.dtype = full_dtype.substr(full_dtype.find('.') + 1);
  if (t.dtype != dtype) {
    throw_type_error(std::string(name) + " must have dtype torch." + dtype + ", got " +
                         full_dtype);
  }
  if (!obj.attr("is_contiguous")().cast<bool>()) {
    throw_invalid_argument(std::string(name) + " must be contiguous (call .contiguous())");
  }
  for (py::handle s : obj.attr("shape")) t.shape.push_back(s.cast<int64_t>());
  t.ptr = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<uintptr_t>());
  return t;
}

Tensor optional_cuda_tensor(py::handle obj, const char* name, const char* dtype) {
  if (obj.is_none()) {
    Tensor t;
    t.name = name;
    return t;
  }
  return cuda_tensor(obj, name, dtype);
}

void expect_shape(const Tensor& t, const std::vector<int64_t>& expected) {
  bool ok = t.shape.size() == expected.size();
  for (size_t i = 0; ok && i < expected.size(); ++i) {
    ok = expected[i] < 0 || expected[i] == t.shape[i];
  }
  if (!ok) {
    throw_invalid_argument(t.name + " must have shape " + shape_str(expected) + " (-1: any), got " +
                          shape_str(t.shape));
  }
}

int checked_int(int64_t value, const std::string& what) {
  if (value > INT_MAX) {
    throw_invalid_argument(what + " is " + std::to_string(value) + "; the kernels take at most " +
                          std::to_string(INT_MAX) + " (split the batch)");
  }
  return static_cast<int>(value);
}

int32_t* mapped_host_ids(py::object host_out, int64_t rows, const char* op) {
  if (host_out.is_none()) return nullptr;
  const bool usable = py::str(host_out.attr("device").attr("type")).cast<std::string>() == "cpu" &&
                      host_out.attr("is_pinned")().cast<bool>() &&
                      py::str(host_out.attr("dtype")).cast<std::string>() == "torch.int32" &&
                      host_out.attr("is_contiguous")().cast<bool>() &&
                      host_out.attr("numel")().cast<int64_t>() == rows;
  if (!usable) {
    throw_invalid_argument(std::string(op) + ": host_out must be a contiguous pinned CPU int32 tensor of " +
                           std::to_string(rows) +
                           " elements (torch.empty(rows, dtype=torch.int32, pin_memory=True))");
  }
  // The kernel's address of the page-locked memory (the host's own under unified addressing for
  // cudaHostAlloc, not necessarily for registered memory).
  void* mapped = nullptr;
  void* pinned = reinterpret_cast<void*>(host_out.attr("data_ptr")().cast<uintptr_t>());
  if (cudaHostGetDevicePointer(&mapped, pinned, 0) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    throw_invalid_argument(std::string(op) + ": host_out's memory is not mapped for the GPU; allocate it "
                           "with torch.empty(..., pin_memory=True)");
  }
  return static_cast<int32_t*>(mapped);
}

std::pair<Tensor, int64_t> row_strided_logits(py::object logits, const char* dtype) {
  const auto stride = logits.attr("stride")().cast<std::vector<int64_t>>();
  if (stride.size() != 2) {
    throw_invalid_argument("logits must be 2-D [rows, vocab], got " + std::to_string(stride.size()) +
                          " dimensions");
  }
  const auto shape = logits.attr("shape").cast<std::vector<int64_t>>();
  if (shape[0] > 1 && (stride[1] != 1 || stride[0] < shape[1])) {
    throw_invalid_argument("logits must have unit stride along vocab and rows that do not overlap, "
                          "got strides (" + std::to_string(stride[0]) + ", " +
                          std::to_string(stride[1]) + "); call .contiguous()");
  }
  // One row is contiguous, so it passes the usual device/dtype/contiguity checks.
  py::object first_row = shape[0] > 0 ? logits.attr("narrow")(0, 0, 1) : logits;
  Tensor t = cuda_tensor(first_row, "logits", dtype);
  t.shape = shape;
  return {t, shape[0] > 1 ? stride[0] : shape[1]};
}

int same_device(const std::vector<const Tensor*>& tensors) {
  int device = -1;
  for (const Tensor* t : tensors) {
    if (t->ptr == nullptr) continue;
    if (device >= 0 && t->device != device) {
      throw_invalid_argument("all tensors must be on one device; " + t->name + " is on cuda:" +
                            std::to_string(t->device) + ", others on cuda:" +
                            std::to_string(device));
    }
    device = t->device;
  }
  if (device >= 0) cudaSetDevice(device);
  return device;
}

cudaStream_t torch_current_stream() {
  py::object stream = py::module_::import("torch").attr("cuda").attr("current_stream")();
  return reinterpret_cast<cudaStream_t>(stream.attr("cuda_stream").cast<uintptr_t>());
}

int register_binder(Binder binder) {
  binders().push_back(binder);
  return static_cast<int>(binders().size());
}

void run_binders(py::module_& m) {
  for (Binder b : binders()) b(m);
}

}  // namespace nanograph::py_ext
