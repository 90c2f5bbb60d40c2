// The Python binding `_jbs_kernels`: exports the FFI handler capsules and build facts.
//
// Always holds the CPU handlers. When built for CUDA architectures (CMakeLists.txt) it
// also holds the CUDA handlers (and defines JBS_WITH_CUDA); the CUDA runtime is linked statically and
// nothing here touches a GPU, so the module imports on machines without one.
#include <iterator>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bsmm_work_plan.h"
#include "cpu/bsmm_cpu.h"
#include "xla/ffi/api/api.h"

#ifdef JBS_WITH_CUDA
#include "bsmm_cuda_info.h"
#endif
#ifdef JBS_WITH_SM90
#include "sm90/bsmm_sm90_tf32.h"  // no CUDA headers
#endif

namespace py = pybind11;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFpropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBpropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmUpdatCpu);
// The block-sparse convolution (cpu/bsconv_cpu_handlers.cc): CPU only; on CUDA the
// convolution runs as bsmm products (jax_blocksparse/ops/conv_primitives.py).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsconvCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsconvWgradCpu);
#ifdef JBS_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFpropCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBpropCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmUpdatCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmInitializeCuda);
#endif
// The Hopper targets (cuda/sm90/), built when sm_90a is among the architectures.
#ifdef JBS_WITH_SM90
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFpropSm90);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBpropSm90);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmUpdatSm90);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmInitializeSm90);
#endif

// The build (CMakeLists.txt) writes jbs_build_info.h with JBS_CUDA_ARCHS ("sm_80,sm_90a,...").
#if __has_include("jbs_build_info.h")
#include "jbs_build_info.h"
#endif
#ifndef JBS_CUDA_ARCHS
#define JBS_CUDA_ARCHS ""
#endif

namespace {

// The FFI target names, versioned: jax_blocksparse/targets.py holds the table (kernel,
// versions, platforms) and its compatibility promise; tests/test_export.py checks that
// registrations() reports exactly its names. A new version of a target is registered
// beside the old one, which stays for the releases that promise says.
constexpr char kFpropV1[] = "jax_blocksparse_bsmm_fprop_v1";
constexpr char kBpropV1[] = "jax_blocksparse_bsmm_bprop_v1";
constexpr char kUpdatV1[] = "jax_blocksparse_bsmm_updat_v1";
constexpr char kBsconvV1[] = "jax_blocksparse_bsconv_v1";
constexpr char kBsconvWgradV1[] = "jax_blocksparse_bsconv_wgrad_v1";
#ifdef JBS_WITH_SM90
constexpr char kFpropSm90V1[] = "jax_blocksparse_bsmm_fprop_sm90_v1";
constexpr char kBpropSm90V1[] = "jax_blocksparse_bsmm_bprop_sm90_v1";
constexpr char kUpdatSm90V1[] = "jax_blocksparse_bsmm_updat_sm90_v1";
#endif

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

// The work plan (bsmm_work_plan.h) enumerated on the host, for tests/test_work_plan.py:
// the same functions the persistent kernels call per item.
py::list WorkPlanDsd(int64_t rows, int32_t tile_m, const std::vector<int32_t>& seg_ptr,
                     const std::vector<int32_t>& order, int32_t pack) {
  if (rows < 0 || tile_m <= 0 || pack <= 0) {
    throw py::value_error("work_plan_dsd: need rows >= 0, tile_m > 0, pack > 0; got rows=" + std::to_string(rows) +
                          ", tile_m=" + std::to_string(tile_m) + ", pack=" + std::to_string(pack));
  }
  if (seg_ptr.empty() || order.size() != seg_ptr.size() - 1) {
    throw py::value_error("work_plan_dsd: order must have len(seg_ptr) - 1 entries; got " +
                          std::to_string(order.size()) + " and " + std::to_string(seg_ptr.size()));
  }
  const int32_t num_outputs = static_cast<int32_t>(order.size());
  for (int32_t o : order) {
    if (o < 0 || o >= num_outputs) throw py::value_error("work_plan_dsd: order holds " + std::to_string(o));
  }
  namespace plan = jbs::plan;
  const plan::DsdPlan p = plan::MakeDsdPlan(rows, tile_m, num_outputs, pack);
  py::list items;
  for (int64_t t = 0; t < plan::DsdNumItems(p); ++t) {
    const plan::DsdItem it = plan::DsdItemAt(p, t);
    const int32_t steps = plan::DsdGroupSteps(p, seg_ptr.data(), order.data(), it.group);
    py::list members;
    for (int32_t m = 0; m < plan::DsdGroupSize(p, it.group); ++m) {
      py::list entries;
      for (int32_t s = 0; s < steps; ++s) entries.append(plan::DsdEntry(p, seg_ptr.data(), order.data(), it.group, m, s));
      members.append(py::make_tuple(plan::DsdOutput(p, order.data(), it.group, m), entries));
    }
    items.append(py::make_tuple(it.m_tile, it.group, plan::DsdRowBegin(p, it), plan::DsdRowEnd(p, it), members));
  }
  return items;
}

py::dict WorkPlanSdd(int32_t capacity, int32_t group, int64_t n, int32_t tile_n, int32_t num_sms, int32_t bs) {
  if (capacity < 0 || group <= 0 || n < 0 || tile_n <= 0 || num_sms <= 0 || bs <= 0) {
    throw py::value_error("work_plan_sdd: need capacity >= 0, group > 0, n >= 0, tile_n > 0, num_sms > 0, bs > 0");
  }
  namespace plan = jbs::plan;
  const plan::SddPlan p = plan::MakeSddPlan(capacity, group, n, tile_n, num_sms);
  py::list items;
  for (int64_t t = 0; t < plan::SddNumItems(p); ++t) {
    const plan::SddItem it = plan::SddItemAt(p, t);
    items.append(py::make_tuple(it.slot_begin, it.slot_end, it.n_begin, it.n_end, it.split));
  }
  py::dict d;
  d["splits"] = p.splits;
  d["split_len"] = p.split_len;
  d["workspace_elems"] = plan::SddWorkspaceElems(p, bs);
  d["items"] = items;
  return d;
}

}  // namespace

PYBIND11_MODULE(_jbs_kernels, m) {
  m.doc() = "jax-blocksparse native kernels (XLA FFI handlers for CPU and, when built, CUDA)";
  m.def("registrations", []() {
    py::dict cpu;
    cpu[kFpropV1] = Capsule(JbsBsmmFpropCpu);
    cpu[kBpropV1] = Capsule(JbsBsmmBpropCpu);
    cpu[kUpdatV1] = Capsule(JbsBsmmUpdatCpu);
    cpu[kBsconvV1] = Capsule(JbsBsconvCpu);
    cpu[kBsconvWgradV1] = Capsule(JbsBsconvWgradCpu);
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
    cuda[kFpropV1] = stages(Capsule(JbsBsmmFpropCuda));
    cuda[kBpropV1] = stages(Capsule(JbsBsmmBpropCuda));
    cuda[kUpdatV1] = stages(Capsule(JbsBsmmUpdatCuda));
#ifdef JBS_WITH_SM90
    auto sm90_stages = [](py::capsule execute) {
      py::dict d;
      d["initialize"] = Capsule(JbsBsmmInitializeSm90);
      d["execute"] = execute;
      return d;
    };
    cuda[kFpropSm90V1] = sm90_stages(Capsule(JbsBsmmFpropSm90));
    cuda[kBpropSm90V1] = sm90_stages(Capsule(JbsBsmmBpropSm90));
    cuda[kUpdatSm90V1] = sm90_stages(Capsule(JbsBsmmUpdatSm90));
#endif
    by_platform["CUDA"] = cuda;
#endif
    return by_platform;
  }, "platform ('cpu', 'CUDA') -> {FFI target name -> handler capsule, or {stage -> capsule}} (api_version 1); "
     "the convolution targets (*_bsconv*_v*) on 'cpu' only, the CUDA Hopper targets (*_sm90_v*) only in a "
     "build for sm_90a.");
  m.def("work_plan_dsd", &WorkPlanDsd, py::arg("rows"), py::arg("tile_m"), py::arg("seg_ptr"), py::arg("order"),
        py::arg("pack"),
        "DSD work items in launch order: (m_tile, group, row_begin, row_end, [(output, [entry or -1 per step])]).");
  m.def("work_plan_sdd", &WorkPlanSdd, py::arg("capacity"), py::arg("group"), py::arg("n"), py::arg("tile_n"),
        py::arg("num_sms"), py::arg("bs"),
        "SDD plan: {splits, split_len, workspace_elems, items: [(slot_begin, slot_end, n_begin, n_end, split)]}.");
  m.def("persistent_grid", [](int64_t items, int32_t num_sms, int32_t ctas_per_sm) {
    return jbs::plan::PersistentGrid(items, num_sms, ctas_per_sm);
  }, "CTAs of a persistent launch over `items` work items.");
  m.def("dsd_pack_for", [](int32_t bs) { return jbs::plan::DsdPackFor(bs); }, "Outputs packed per DSD tile at block size bs.");
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
#ifdef JBS_WITH_SM90
    // Block sizes at which those targets run float32 on TF32 (cuda/sm90/bsmm_sm90_tf32.h).
    py::dict tf32;
    tf32["fprop"] = py::tuple(py::cast(std::vector<int>(std::begin(jbs::sm90::kDsdTF32BlockSizes),
                                                        std::end(jbs::sm90::kDsdTF32BlockSizes))));
    tf32["bprop"] = tf32["fprop"];
    tf32["updat"] = py::tuple(py::cast(std::vector<int>(std::begin(jbs::sm90::kSddTF32BlockSizes),
                                                        std::end(jbs::sm90::kSddTF32BlockSizes))));
    d["sm90_tf32_block_sizes"] = tf32;
#endif
    d["block_sizes"] = py::make_tuple(8, 16, 32, 64, 128);
    return d;
  }, "Facts about this build: CPU instruction set in use, CUDA version and architectures.");
}
