// The Python binding `_jbs_kernels`: exports the FFI handler capsules and build facts.
//
// Always holds the CPU handlers. When build.py found nvcc it also holds the CUDA
// handlers (and defines JBS_WITH_CUDA); the CUDA runtime is linked statically and
// nothing here touches a GPU, so the module imports on machines without one.
#include <string>

#include <pybind11/pybind11.h>

#include "cpu/bsmm_cpu.h"
#include "xla/ffi/api/api.h"

#ifdef JBS_WITH_CUDA
#include "bsmm_cuda_info.h"
#endif

namespace py = pybind11;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFpropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBpropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmUpdatCpu);
#ifdef JBS_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFpropCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBpropCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmUpdatCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmInitializeCuda);
#endif

// build.py writes build/jbs_build_info.h with JBS_CUDA_ARCHS ("sm_80,sm_90a,...").
#if __has_include("jbs_build_info.h")
#include "jbs_build_info.h"
#endif
#ifndef JBS_CUDA_ARCHS
#define JBS_CUDA_ARCHS ""
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

std::string VersionString(int cudart) {
  return std::to_string(cudart / 1000) + "." + std::to_string((cudart % 1000) / 10);
}

}  // namespace

PYBIND11_MODULE(_jbs_kernels, m) {
  m.doc() = "jax-blocksparse native kernels (XLA FFI handlers for CPU and, when built, CUDA)";
  m.def("registrations", []() {
    py::dict cpu;
    cpu["jbs_bsmm_fprop"] = Capsule(JbsBsmmFpropCpu);
    cpu["jbs_bsmm_bprop"] = Capsule(JbsBsmmBpropCpu);
    cpu["jbs_bsmm_updat"] = Capsule(JbsBsmmUpdatCpu);
    py::dict by_platform;
    by_platform["cpu"] = cpu;
#ifdef JBS_WITH_CUDA
    // Two stages each (bsmm_cuda_handlers.cc): "initialize" prepares the kernels outside
    // any CUDA-graph capture, "execute" launches them.
    auto stages = [](py::capsule execute) {
      py::dict d;
      d["initialize"] = Capsule(JbsBsmmInitializeCuda);
      d["execute"] = execute;
      return d;
    };
    py::dict cuda;
    cuda["jbs_bsmm_fprop"] = stages(Capsule(JbsBsmmFpropCuda));
    cuda["jbs_bsmm_bprop"] = stages(Capsule(JbsBsmmBpropCuda));
    cuda["jbs_bsmm_updat"] = stages(Capsule(JbsBsmmUpdatCuda));
    by_platform["CUDA"] = cuda;
#endif
    return by_platform;
  }, "platform ('cpu', 'CUDA') -> {FFI target name -> handler capsule, or {stage -> capsule}} (api_version 1).");
  m.def("build_info", []() {
    py::dict d;
    d["cpu_isa"] = py::str(jbs::cpu::KernelIsa());
#ifdef JBS_WITH_CUDA
    d["cuda"] = true;
    d["cuda_version"] = py::str(VersionString(jbs::CudaRuntimeVersionBuiltAgainst()));
    d["cudart_version"] = jbs::CudaRuntimeVersionBuiltAgainst();
    d["cudart_runtime_version"] = jbs::CudaRuntimeVersionLinked();
    d["archs"] = ArchList();
#else
    d["cuda"] = false;
#endif
    d["targets"] = py::make_tuple("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat");
    d["block_sizes"] = py::make_tuple(8, 16, 32, 64, 128);
    return d;
  }, "Facts about this build: CPU instruction set in use, CUDA version and architectures.");
}
