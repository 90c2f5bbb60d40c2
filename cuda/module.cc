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

#include "bsmm_block_sizes.h"
#include "bsmm_work_plan.h"
#include "cpu/bsmm_cpu.h"
#include "sm90/bsmm_sm90_plan.h"      // no CUDA headers: in every build
#include "sm90/bsmm_sm90_variants.h"  // the same
#include "xla/ffi/api/api.h"

#ifdef JBS_WITH_CUDA
#include "bsmm_cuda_info.h"
#endif

namespace py = pybind11;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFpropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBpropCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmUpdatCpu);
// The block-sparse convolution (cpu/bsconv_cpu_handlers.cc): CPU only; on CUDA the
// convolution runs as bsmm products (jax_blocksparse/ops/conv_primitives.py).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsconvCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsconvWgradCpu);
// The dense path's conversions between blocks and the dense matrix, and updat's x^T
// (cpu/bsmm_cpu_dense.cc): CPU only; on CUDA XLA's own scatter, gather and transpose run them.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBlocksToDenseCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBlocksToDenseCpuV2);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsDenseToBlocksCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsTransposeCpu);
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
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmFpropSm90V2);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JbsBsmmBpropSm90V2);
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
constexpr char kBlocksToDenseV1[] = "jax_blocksparse_blocks_to_dense_v1";
constexpr char kBlocksToDenseV2[] = "jax_blocksparse_blocks_to_dense_v2";
constexpr char kDenseToBlocksV1[] = "jax_blocksparse_dense_to_blocks_v1";
constexpr char kTransposeV1[] = "jax_blocksparse_transpose_v1";
#ifdef JBS_WITH_SM90
constexpr char kFpropSm90V1[] = "jax_blocksparse_bsmm_fprop_sm90_v1";
constexpr char kBpropSm90V1[] = "jax_blocksparse_bsmm_bprop_sm90_v1";
constexpr char kUpdatSm90V1[] = "jax_blocksparse_bsmm_updat_sm90_v1";
constexpr char kFpropSm90V2[] = "jax_blocksparse_bsmm_fprop_sm90_v2";
constexpr char kBpropSm90V2[] = "jax_blocksparse_bsmm_bprop_sm90_v2";
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
      for (int32_t s = 0; s < steps; ++s)
        entries.append(plan::DsdEntry(p, seg_ptr.data(), order.data(), it.group, m, s));
      members.append(py::make_tuple(plan::DsdOutput(p, order.data(), it.group, m), entries));
    }
    items.append(py::make_tuple(it.m_tile, it.group, plan::DsdRowBegin(p, it), plan::DsdRowEnd(p, it), members));
  }
  return items;
}

// The stacked DSD variant's plan (bsmm_work_plan.h: pack 1, entries of the work list
// stacked `depth` per step), for tests/test_work_plan.py.
py::list WorkPlanDsdStacked(int64_t rows, int32_t tile_m, const std::vector<int32_t>& work_ptr,
                            const std::vector<int32_t>& order, int32_t capacity, int32_t depth) {
  if (rows < 0 || tile_m <= 0 || depth <= 0 || capacity < 0) {
    throw py::value_error("work_plan_dsd_stacked: need rows >= 0, tile_m > 0, depth > 0, capacity >= 0; got rows=" +
                          std::to_string(rows) + ", tile_m=" + std::to_string(tile_m) +
                          ", depth=" + std::to_string(depth) + ", capacity=" + std::to_string(capacity));
  }
  if (work_ptr.empty() || order.size() != work_ptr.size() - 1) {
    throw py::value_error("work_plan_dsd_stacked: order must have len(work_ptr) - 1 entries; got " +
                          std::to_string(order.size()) + " and " + std::to_string(work_ptr.size()));
  }
  namespace plan = jbs::plan;
  const plan::DsdPlan p = plan::MakeDsdPlan(rows, tile_m, static_cast<int32_t>(order.size()), 1);
  py::list items;
  for (int64_t t = 0; t < plan::DsdNumItems(p); ++t) {
    const plan::DsdItem it = plan::DsdStackedItemAt(p, t);
    const plan::StackedRange range = plan::DsdStackedRange(work_ptr.data(), capacity, it.group);
    py::list steps;
    for (int32_t s = 0; s < plan::DsdStackedSteps(range, depth); ++s) {
      py::list entries;
      for (int32_t d = 0; d < depth; ++d) entries.append(plan::DsdStackedEntry(range, depth, s, d));
      steps.append(entries);
    }
    items.append(py::make_tuple(it.m_tile, order[it.group], plan::DsdRowBegin(p, it), plan::DsdRowEnd(p, it), steps));
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

template <int N>
py::tuple IntTuple(const int (&values)[N]) {
  return py::tuple(py::cast(std::vector<int>(std::begin(values), std::end(values))));
}

// build_info()["sm90"]: what the Hopper kernels of these sources do (sm90/bsmm_sm90_plan.h,
// sm90/bsmm_sm90_tf32.h), in every build: the lowering (jax_blocksparse/ops/_sm90.py)
// reads them instead of keeping copies; whether the kernels are compiled in, registrations() says.
py::dict Sm90Facts() {
  namespace sm90 = jbs::sm90;
  py::dict tf32;  // op -> block sizes with TF32
  tf32["fprop"] = IntTuple(sm90::kDsdTF32BlockSizes);
  tf32["bprop"] = IntTuple(sm90::kDsdTF32BlockSizes);
  tf32["updat"] = IntTuple(sm90::kSddTF32BlockSizes);
  py::dict off;  // op -> {block size -> why TF32 is off there}: plain keys, so the facts serialise as JSON
  const struct {
    const char* op;
    bool (*on)(int);
    const char* why;
  } products[] = {{"fprop", sm90::DsdTF32Block, sm90::kDsdTF32Off},
                  {"bprop", sm90::DsdTF32Block, sm90::kDsdTF32Off},
                  {"updat", sm90::SddTF32Block, sm90::kSddTF32Off}};
  for (const auto& product : products) {
    py::dict why;
    for (int bs : jbs::kBlockSizes) {
      if (!product.on(bs)) why[py::int_(bs)] = product.why;
    }
    if (py::len(why) > 0) off[product.op] = why;
  }
  py::dict d;
  d["plan_sms"] = sm90::kPlanSms;
  d["tf32_block_sizes"] = tf32;
  d["tf32_off"] = off;
  d["tf32_row_multiple"] = sm90::kSddTF32RowMultiple;
  // The kernel variants (bsmm_sm90_variants.h).
  py::dict variants;
  // op -> variant -> mode -> block sizes it runs.
  const struct {
    const char* mode;
    jbs::DType in;
    bool tf32;
  } modes[] = {{"bfloat16", jbs::DType::kBF16, false},
               {"float16", jbs::DType::kF16, false},
               {"float32", jbs::DType::kF32, false},
               {"tf32", jbs::DType::kF32, true}};
  auto by_mode = [&](auto runs) {
    py::dict out;
    for (const auto& m : modes) {
      std::vector<int> sizes;
      for (int bs : jbs::kBlockSizes) {
        if (runs(m.in, m.tf32, bs)) sizes.push_back(bs);
      }
      if (!sizes.empty()) out[m.mode] = py::tuple(py::cast(sizes));
    }
    return out;
  };
  for (const char* op : {"fprop", "bprop"}) {
    py::dict by_variant;
    for (int v = 0; v < sm90::kNumDsdVariants; ++v) {
      const auto variant = static_cast<sm90::DsdVariant>(v);
      by_variant[sm90::kDsdVariantNames[v]] =
          by_mode([&](jbs::DType in, bool tf32, int bs) { return sm90::DsdVariantRuns(variant, in, tf32, bs); });
    }
    variants[op] = by_variant;
  }
  py::dict updat;  // every SDD variant runs every product (they differ in their plan)
  for (int v = 0; v < sm90::kNumSddVariants; ++v) {
    updat[sm90::kSddVariantNames[v]] = by_mode([](jbs::DType, bool, int) { return true; });
  }
  variants["updat"] = updat;
  d["variants"] = variants;
  d["updat_capped_workspace_bytes"] = static_cast<int64_t>(sm90::kSddCappedWorkspaceBytes);
  return d;
}

// The workspace bytes of jbs_bsmm_updat_sm90 for an updat of x [n, cb * bs], dy [n, kb * bs]
// into dw [capacity, bs, bs] (with tf32: the padded n of x^T / dy^T): the handler's own
// SddWorkspaceBytes, so the lowering allocates exactly what the handler checks for.
// The variant (bsmm_sm90_variants.h) decides the SM count planned for: the baseline's
// num_sms, the capped one's the largest the handler's search reaches within its budget.
int64_t Sm90UpdatWorkspaceBytes(const std::string& dtype, int64_t n, int32_t cb, int32_t kb, int32_t capacity,
                                int32_t bs, bool tf32, int32_t num_sms, const std::string& variant) {
  jbs::DType in;
  if (dtype == "float32") {
    in = jbs::DType::kF32;
  } else if (dtype == "float16") {
    in = jbs::DType::kF16;
  } else if (dtype == "bfloat16") {
    in = jbs::DType::kBF16;
  } else {
    throw py::value_error("sm90_updat_workspace_bytes: dtype must be float32, float16 or bfloat16, got '" + dtype +
                          "'");
  }
  if (n < 0 || cb < 0 || kb < 0 || capacity < 0 || bs <= 0 || num_sms <= 0) {
    throw py::value_error(
        "sm90_updat_workspace_bytes: need n >= 0, cb >= 0, kb >= 0, capacity >= 0, bs > 0, "
        "num_sms > 0; got n=" +
        std::to_string(n) + ", cb=" + std::to_string(cb) + ", kb=" + std::to_string(kb) + ", capacity=" +
        std::to_string(capacity) + ", bs=" + std::to_string(bs) + ", num_sms=" + std::to_string(num_sms));
  }
  jbs::SddParams p{};
  p.n = n;
  p.cb = cb;
  p.kb = kb;
  p.cap = capacity;
  p.bs = bs;
  namespace sm90 = jbs::sm90;
  if (variant == sm90::kSddVariantNames[static_cast<int>(sm90::SddVariant::kCapped)]) {
    num_sms = sm90::SddPlanSmsWithin(in, p, sm90::kSddCappedWorkspaceBytes, tf32, num_sms);
  } else if (variant != sm90::kSddVariantNames[static_cast<int>(sm90::SddVariant::kBaseline)]) {
    throw py::value_error("sm90_updat_workspace_bytes: unknown updat variant '" + variant +
                          "' (cuda/sm90/bsmm_sm90_variants.h names them)");
  }
  return static_cast<int64_t>(sm90::SddWorkspaceBytes(in, p, num_sms, tf32));
}

}  // namespace

PYBIND11_MODULE(_jbs_kernels, m) {
  m.doc() = "jax-blocksparse native kernels (XLA FFI handlers for CPU and, when built, CUDA)";
  m.def(
      "registrations",
      []() {
        py::dict cpu;
        cpu[kFpropV1] = Capsule(JbsBsmmFpropCpu);
        cpu[kBpropV1] = Capsule(JbsBsmmBpropCpu);
        cpu[kUpdatV1] = Capsule(JbsBsmmUpdatCpu);
        cpu[kBsconvV1] = Capsule(JbsBsconvCpu);
        cpu[kBsconvWgradV1] = Capsule(JbsBsconvWgradCpu);
        cpu[kBlocksToDenseV1] = Capsule(JbsBlocksToDenseCpu);
        cpu[kBlocksToDenseV2] = Capsule(JbsBlocksToDenseCpuV2);
        cpu[kDenseToBlocksV1] = Capsule(JbsDenseToBlocksCpu);
        cpu[kTransposeV1] = Capsule(JbsTransposeCpu);
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
        cuda[kFpropSm90V2] = sm90_stages(Capsule(JbsBsmmFpropSm90V2));
        cuda[kBpropSm90V2] = sm90_stages(Capsule(JbsBsmmBpropSm90V2));
#endif
        by_platform["CUDA"] = cuda;
#endif
        return by_platform;
      },
      "platform ('cpu', 'CUDA') -> {FFI target name -> handler capsule, or {stage -> capsule}} (api_version 1); "
      "the convolution targets (*_bsconv*_v*) on 'cpu' only, the CUDA Hopper targets (*_sm90_v*) only in a "
      "build for sm_90a.");
  m.def("work_plan_dsd", &WorkPlanDsd, py::arg("rows"), py::arg("tile_m"), py::arg("seg_ptr"), py::arg("order"),
        py::arg("pack"),
        "DSD work items in launch order: (m_tile, group, row_begin, row_end, [(output, [entry or -1 per step])]).");
  m.def("work_plan_dsd_stacked", &WorkPlanDsdStacked, py::arg("rows"), py::arg("tile_m"), py::arg("work_ptr"),
        py::arg("order"), py::arg("capacity"), py::arg("depth"),
        "Stacked DSD work items in launch order: (m_tile, output, row_begin, row_end, [[work-list entry or -1 "
        "per member] per step]).");
  m.def("work_plan_sdd", &WorkPlanSdd, py::arg("capacity"), py::arg("group"), py::arg("n"), py::arg("tile_n"),
        py::arg("num_sms"), py::arg("bs"),
        "SDD plan: {splits, split_len, workspace_elems, items: [(slot_begin, slot_end, n_begin, n_end, split)]}.");
  m.def(
      "persistent_grid",
      [](int64_t items, int32_t num_sms, int32_t ctas_per_sm) {
        return jbs::plan::PersistentGrid(items, num_sms, ctas_per_sm);
      },
      "CTAs of a persistent launch over `items` work items.");
  m.def(
      "dsd_pack_for", [](int32_t bs) { return jbs::plan::DsdPackFor(bs); },
      "Outputs packed per DSD tile at block size bs.");
  m.def("sm90_updat_workspace_bytes", &Sm90UpdatWorkspaceBytes, py::arg("dtype"), py::arg("n"), py::arg("cb"),
        py::arg("kb"), py::arg("capacity"), py::arg("bs"), py::arg("tf32") = false,
        py::arg("num_sms") = jbs::sm90::kPlanSms, py::arg("variant") = "baseline",
        "Bytes of the jbs_bsmm_updat_sm90 workspace (SddWorkspaceBytes) for x [n, cb * bs], dy [n, kb * bs] and "
        "dw [capacity, bs, bs] of dtype ('float32', 'float16', 'bfloat16'); 0 where the split plan needs none. "
        "variant 'capped': the splits capped so that it is at most the capped budget (bsmm_sm90_variants.h).");
  m.def(
      "amx_peak_probe",
      [](int64_t steps) -> py::object {
        double flops;
        {
          py::gil_scoped_release release;
          flops = jbs::cpu::AmxPeakProbe(steps);
        }
        return flops < 0 ? py::object(py::none()) : py::object(py::float_(flops));
      },
      py::arg("steps"),
      "FLOPs of steps x 4 AMX TDPBF16PS on operands held in the tiles, on the calling thread (None without AMX): "
      "time it for the unit's peak. Releases the GIL, so that one call per core can run at once.");
  m.def(
      "build_info",
      []() {
        py::dict d;
        d["cpu_isa"] = py::str(jbs::cpu::KernelIsa());  // in force (JAX_BLOCKSPARSE_CPU_ISA may lower it)
        d["cpu_isa_detected"] = py::str(jbs::cpu::DetectedIsa());
        py::list isas;  // lowest to widest: JAX_BLOCKSPARSE_CPU_ISA may name any up to the detected one
        for (int i = 0; i < jbs::cpu::IsaCount(); ++i) isas.append(py::str(jbs::cpu::IsaName(i)));
        d["cpu_isas"] = py::tuple(isas);
        const char* isa_error = jbs::cpu::IsaOverrideError();
        d["cpu_isa_error"] = isa_error ? py::object(py::str(isa_error)) : py::object(py::none());
#ifdef JBS_WITH_CUDA
        d["cuda"] = true;
        d["cuda_version"] = py::str(VersionString(jbs::CudaRuntimeVersionBuiltAgainst()));
        d["cudart_version"] = jbs::CudaRuntimeVersionBuiltAgainst();
        d["cudart_runtime_version"] = jbs::CudaRuntimeVersionLinked();
        d["archs"] = ArchList();
#else
        d["cuda"] = false;
#endif
        d["block_sizes"] = IntTuple(jbs::kBlockSizes);  // jax_blocksparse/block_sizes.json
        d["sm90"] = Sm90Facts();
        return d;
      },
      "Facts about this build: CPU instruction set in use, CUDA version and architectures, block sizes, "
      "the Hopper kernels' plan and TF32 tables.");
}
