// The Python binding `_jbs_cuda`: exports the FFI handler capsules and build facts.
// Nothing here touches a GPU, so the module imports on machines without one.
#include <string>

#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include "xla/ffi/api/api.h"

namespace py = pybind11;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFprop);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBprop);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmUpdat);

// build.py writes build/jbs_build_info.h with JBS_CUDA_ARCHS ("sm_80,sm_90a,...").
#if __has_include("jbs_build_info.h")
#include "jbs_build_info.h"
#endif
#ifndef JBS_CUDA_ARCHS
#define JBS_CUDA_ARCHS "unknown"
#endif

namespace {

template <typename Fn>
py::capsule Capsule(Fn* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

py::list ArchList() {
  py::list archs;
  std::string all = JBS_CUDA_ARCHS;
  size_t start = 0;
  while (start <= all.size()) {
    size_t comma = all.find(',', start);
    if (comma == std::string::npos) comma = all.size();
    if (comma > start) archs.append(all.substr(start, comma - start));
    start = comma + 1;
  }
  return archs;
}

}  // namespace

PYBIND11_MODULE(_jbs_cuda, m) {
  m.doc() = "jax-blocksparse CUDA kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    py::dict d;
    d["jbs_bsmm_fprop"] = Capsule(JbsBsmmFprop);
    d["jbs_bsmm_bprop"] = Capsule(JbsBsmmBprop);
    d["jbs_bsmm_updat"] = Capsule(JbsBsmmUpdat);
    return d;
  }, "FFI target name -> handler capsule (api_version 1), for jax.ffi.register_ffi_target.");
  m.def("build_info", []() {
    py::dict d;
    d["cuda_version"] = py::str(std::to_string(CUDART_VERSION / 1000) + "." +
                                std::to_string((CUDART_VERSION % 1000) / 10));
    d["cudart_version"] = CUDART_VERSION;
    int runtime = 0;  // the statically linked runtime; works without a driver
    d["cudart_runtime_version"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess ? runtime : -1;
    d["archs"] = ArchList();
    d["targets"] = py::make_tuple("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat");
    d["block_sizes"] = py::make_tuple(8, 16, 32, 64, 128);
    return d;
  }, "Facts about this build: CUDA version, compiled architectures, targets.");
}
