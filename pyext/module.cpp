// The nanograph._C extension module: each pyext/*.cpp file adds its bindings through
// NANOGRAPH_BINDINGS; this file creates the module and maps core errors to Python ones.
#include <pybind11/pybind11.h>

#include <cuda_runtime.h>

#include "../csrc/common.h"
#include "tensor.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "nanograph C++/CUDA core";
  // Local translators run before any shared ones (see tensor.h on why that matters).
  py::register_local_exception<nanograph::CudaError>(m, "CudaError", PyExc_RuntimeError);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const nanograph::ArgumentTypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def(
      "device_count",
      [] {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess) {
          cudaGetLastError();
          return 0;
        }
        return n;
      },
      "Number of CUDA devices the core can see (0 without a GPU or driver).");
  nanograph::py_ext::run_binders(m);
}
