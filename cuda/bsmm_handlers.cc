// XLA FFI handlers of the bsmm custom calls: argument checks, error returns, launches.
//
// Targets (operands in order; every table is int32 rank 1; see layout.py):
//
//   jbs_bsmm_fprop(x [N..., C], w [cap, bs, bs], block_rows [cap], block_cols [cap],
//                  col_ptr [KB + 1], row_ptr [CB + 1], row_slots [cap], order [KB])
//       -> y [N..., K]
//   jbs_bsmm_bprop(g [N..., K], w [cap, bs, bs], <same five tables>, order [CB])
//       -> dx [N..., C]
//   jbs_bsmm_updat(x [N..., C], dy [N..., K], <same five tables>) -> dw [cap, bs, bs]
//
// `order` is the extra operand computed by the lowering (ops/_lowering.py): the output
// block columns (fprop) / rows (bprop) sorted longest first; CTAs visit them in that order.
// Inputs are float32, float16 or bfloat16 (both float operands alike); the output is the
// input dtype or float32. bs = w.shape[-1] (fprop, bprop) or dw.shape[-1] (updat).
//
// The handlers never allocate, synchronise or read device memory on the host, so they
// are CUDA-graph (command buffer) compatible. Shapes are checked again here because a
// custom call can be built by hand; any mismatch returns ffi::Error naming the op.
#include <cstdint>
#include <sstream>
#include <string>

#include <cuda_runtime_api.h>

#include "bsmm_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jbs {
namespace {

std::string ShapeStr(const ffi::AnyBuffer& b) {
  std::ostringstream os;
  os << "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::S32: return "int32";
    default: return "unsupported dtype";
  }
}

bool ToDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    default: return false;
  }
}

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// Product of all dims but the last (the number of rows), and the last dim.
void RowsAndFeatures(const ffi::AnyBuffer& b, int64_t* rows, int64_t* features) {
  auto dims = b.dimensions();
  int64_t n = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) n *= dims[i];
  *rows = n;
  *features = dims.size() == 0 ? 0 : dims[dims.size() - 1];
}

// The five layout tables, checked against capacity and grid.
struct Tables {
  const int32_t* block_rows;
  const int32_t* block_cols;
  const int32_t* col_ptr;
  const int32_t* row_ptr;
  const int32_t* row_slots;
  int64_t cap, cb, kb;
};

ffi::Error CheckTables(const char* op, const ffi::AnyBuffer& block_rows, const ffi::AnyBuffer& block_cols,
                       const ffi::AnyBuffer& col_ptr, const ffi::AnyBuffer& row_ptr,
                       const ffi::AnyBuffer& row_slots, Tables* t) {
  const ffi::AnyBuffer* all[] = {&block_rows, &block_cols, &col_ptr, &row_ptr, &row_slots};
  const char* names[] = {"block_rows", "block_cols", "col_ptr", "row_ptr", "row_slots"};
  for (int i = 0; i < 5; ++i) {
    if (all[i]->element_type() != ffi::DataType::S32 || all[i]->dimensions().size() != 1) {
      return Invalid(op, std::string(names[i]) + " must be a rank-1 int32 table, got " +
                             DtypeName(all[i]->element_type()) + " " + ShapeStr(*all[i]));
    }
  }
  t->cap = block_rows.dimensions()[0];
  t->kb = col_ptr.dimensions()[0] - 1;
  t->cb = row_ptr.dimensions()[0] - 1;
  if (t->kb < 0 || t->cb < 0) {
    return Invalid(op, "col_ptr and row_ptr need at least one entry, got " + ShapeStr(col_ptr) +
                           " and " + ShapeStr(row_ptr));
  }
  if (block_cols.dimensions()[0] != t->cap || row_slots.dimensions()[0] != t->cap) {
    return Invalid(op, "block_rows, block_cols and row_slots must all be [capacity], got " +
                           ShapeStr(block_rows) + ", " + ShapeStr(block_cols) + ", " + ShapeStr(row_slots));
  }
  if (t->cap > INT32_MAX || t->cb > INT32_MAX || t->kb > INT32_MAX) {
    return Invalid(op, "layout too large for int32 tables");
  }
  t->block_rows = static_cast<const int32_t*>(block_rows.untyped_data());
  t->block_cols = static_cast<const int32_t*>(block_cols.untyped_data());
  t->col_ptr = static_cast<const int32_t*>(col_ptr.untyped_data());
  t->row_ptr = static_cast<const int32_t*>(row_ptr.untyped_data());
  t->row_slots = static_cast<const int32_t*>(row_slots.untyped_data());
  return ffi::Error::Success();
}

// Input dtype must be supported and shared; output is the input dtype or float32.
ffi::Error CheckDtypes(const char* op, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                       const ffi::AnyBuffer& out, DType* in, bool* out_f32) {
  if (!ToDType(a.element_type(), in) || a.element_type() != b.element_type()) {
    return Invalid(op, std::string("inputs must share one dtype among float32, float16, bfloat16, got ") +
                           DtypeName(a.element_type()) + " " + ShapeStr(a) + " and " +
                           DtypeName(b.element_type()) + " " + ShapeStr(b));
  }
  if (out.element_type() != a.element_type() && out.element_type() != ffi::DataType::F32) {
    return Invalid(op, std::string("output dtype must be the input dtype or float32, got ") +
                           DtypeName(out.element_type()) + " for " + DtypeName(a.element_type()) + " inputs");
  }
  *out_f32 = out.element_type() == ffi::DataType::F32;
  return ffi::Error::Success();
}

// Makes the stream's device current, so that per-device calls (cudaFuncSetAttribute)
// and launches address the device XLA runs this op on.
ffi::Error UseStreamDevice(const char* op, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  int device = -1;
  cudaError_t err = cudaStreamGetDevice(stream, &device);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": cannot select the stream's device: " +
                                cudaGetErrorString(err));
  }
#else
  (void)op;
  (void)stream;  // XLA has made the device current on this thread
#endif
  return ffi::Error::Success();
}

ffi::Error LaunchError(const char* op, cudaError_t err, const std::string& shapes) {
  return ffi::Error::Internal(std::string(op) + ": kernel launch failed (" + cudaGetErrorString(err) +
                              ") for " + shapes);
}

// fprop (transpose = false) and bprop (transpose = true).
ffi::Error DsdImpl(const char* op, bool transpose, cudaStream_t stream, ffi::AnyBuffer a,
                   ffi::AnyBuffer w, ffi::AnyBuffer block_rows, ffi::AnyBuffer block_cols,
                   ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr, ffi::AnyBuffer row_slots,
                   ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> out) {
  const std::string shapes = "lhs " + ShapeStr(a) + ", w " + ShapeStr(w) + ", out " + ShapeStr(*out);
  Tables t;
  if (ffi::Error e = CheckTables(op, block_rows, block_cols, col_ptr, row_ptr, row_slots, &t); e.failure()) return e;
  DType in;
  bool out_f32;
  if (ffi::Error e = CheckDtypes(op, a, w, *out, &in, &out_f32); e.failure()) return e;
  auto wd = w.dimensions();
  if (wd.size() != 3 || wd[0] != t.cap || wd[1] != wd[2] || !SupportedBlockSize(static_cast<int>(wd[2]))) {
    return Invalid(op, "w must be [capacity=" + std::to_string(t.cap) +
                           ", bs, bs] with bs in {8, 16, 32, 64, 128}; got " + shapes);
  }
  const int64_t bs = wd[2];
  const int64_t nin = transpose ? t.kb : t.cb;
  const int64_t nseg = transpose ? t.cb : t.kb;
  int64_t n, fin, n_out, fout;
  if (a.dimensions().size() < 1 || out->dimensions().size() != a.dimensions().size()) {
    return Invalid(op, "lhs and out must have the same rank >= 1; got " + shapes);
  }
  RowsAndFeatures(a, &n, &fin);
  RowsAndFeatures(*out, &n_out, &fout);
  auto ad = a.dimensions();
  auto od = out->dimensions();
  for (size_t i = 0; i + 1 < ad.size(); ++i) {
    if (ad[i] != od[i]) return Invalid(op, "lhs and out must share leading dims; got " + shapes);
  }
  if (fin != nin * bs || fout != nseg * bs) {
    return Invalid(op, "need lhs [..., " + std::to_string(nin * bs) + "] and out [..., " +
                           std::to_string(nseg * bs) + "] for a layout grid (" + std::to_string(t.cb) +
                           ", " + std::to_string(t.kb) + ") of block " + std::to_string(bs) + "; got " + shapes);
  }
  if (order.element_type() != ffi::DataType::S32 || order.dimensions().size() != 1 ||
      order.dimensions()[0] != nseg) {
    return Invalid(op, "order must be int32 [" + std::to_string(nseg) + "], got " +
                           DtypeName(order.element_type()) + " " + ShapeStr(order));
  }
  if (n == 0 || nseg == 0) return ffi::Error::Success();  // empty output
  if (ffi::Error e = UseStreamDevice(op, stream); e.failure()) return e;

  DsdParams p;
  p.a = a.untyped_data();
  p.w = w.untyped_data();
  p.out = out->untyped_data();
  p.seg_ptr = transpose ? t.row_ptr : t.col_ptr;
  p.seg_slots = transpose ? t.row_slots : nullptr;
  p.in_block = transpose ? t.block_cols : t.block_rows;
  p.order = static_cast<const int32_t*>(order.untyped_data());
  p.nnz = t.col_ptr + t.kb;  // col_ptr[KB] == nnz
  p.n = n;
  p.nin = static_cast<int>(nin);
  p.nseg = static_cast<int>(nseg);
  p.cap = static_cast<int>(t.cap);
  p.bs = static_cast<int>(bs);
  cudaError_t err = LaunchDsd(in, out_f32, transpose, p, stream);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, shapes);
  return ffi::Error::Success();
}

ffi::Error FpropImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> y) {
  return DsdImpl("jbs_bsmm_fprop", false, stream, x, w, block_rows, block_cols, col_ptr, row_ptr,
                 row_slots, order, y);
}

ffi::Error BpropImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer w, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::AnyBuffer order, ffi::Result<ffi::AnyBuffer> dx) {
  return DsdImpl("jbs_bsmm_bprop", true, stream, g, w, block_rows, block_cols, col_ptr, row_ptr,
                 row_slots, order, dx);
}

ffi::Error UpdatImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer block_rows,
                     ffi::AnyBuffer block_cols, ffi::AnyBuffer col_ptr, ffi::AnyBuffer row_ptr,
                     ffi::AnyBuffer row_slots, ffi::Result<ffi::AnyBuffer> dw) {
  const char* op = "jbs_bsmm_updat";
  const std::string shapes = "x " + ShapeStr(x) + ", dy " + ShapeStr(dy) + ", dw " + ShapeStr(*dw);
  Tables t;
  if (ffi::Error e = CheckTables(op, block_rows, block_cols, col_ptr, row_ptr, row_slots, &t); e.failure()) return e;
  DType in;
  bool out_f32;
  if (ffi::Error e = CheckDtypes(op, x, dy, *dw, &in, &out_f32); e.failure()) return e;
  auto wd = dw->dimensions();
  if (wd.size() != 3 || wd[0] != t.cap || wd[1] != wd[2] || !SupportedBlockSize(static_cast<int>(wd[2]))) {
    return Invalid(op, "dw must be [capacity=" + std::to_string(t.cap) +
                           ", bs, bs] with bs in {8, 16, 32, 64, 128}; got " + shapes);
  }
  const int64_t bs = wd[2];
  auto xd = x.dimensions();
  auto yd = dy.dimensions();
  if (xd.size() < 1 || xd.size() != yd.size()) {
    return Invalid(op, "x and dy must have the same rank >= 1; got " + shapes);
  }
  for (size_t i = 0; i + 1 < xd.size(); ++i) {
    if (xd[i] != yd[i]) return Invalid(op, "x and dy must share leading dims; got " + shapes);
  }
  int64_t n, c, n2, k;
  RowsAndFeatures(x, &n, &c);
  RowsAndFeatures(dy, &n2, &k);
  if (c != t.cb * bs || k != t.kb * bs) {
    return Invalid(op, "need x [..., " + std::to_string(t.cb * bs) + "] and dy [..., " +
                           std::to_string(t.kb * bs) + "] for a layout grid (" + std::to_string(t.cb) + ", " +
                           std::to_string(t.kb) + ") of block " + std::to_string(bs) + "; got " + shapes);
  }
  if (t.cap == 0) return ffi::Error::Success();  // empty output
  if (ffi::Error e = UseStreamDevice(op, stream); e.failure()) return e;

  SddParams p;
  p.x = x.untyped_data();
  p.dy = dy.untyped_data();
  p.dw = dw->untyped_data();
  p.block_rows = t.block_rows;
  p.block_cols = t.block_cols;
  p.nnz = t.col_ptr + t.kb;
  p.n = n;  // n == 0 is fine: the kernel stores zeros
  p.cb = static_cast<int>(t.cb);
  p.kb = static_cast<int>(t.kb);
  p.cap = static_cast<int>(t.cap);
  p.bs = static_cast<int>(bs);
  cudaError_t err = LaunchSdd(in, out_f32, p, stream);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) return LaunchError(op, err, shapes);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jbs

// Bindings. Every argument is bound in operand order; comments name what it holds.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmFprop, jbs::FpropImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<ffi::AnyBuffer>()  // x [N..., C]
                                  .Arg<ffi::AnyBuffer>()  // w [cap, bs, bs]
                                  .Arg<ffi::AnyBuffer>()  // block_rows [cap]
                                  .Arg<ffi::AnyBuffer>()  // block_cols [cap]
                                  .Arg<ffi::AnyBuffer>()  // col_ptr [KB + 1]
                                  .Arg<ffi::AnyBuffer>()  // row_ptr [CB + 1]
                                  .Arg<ffi::AnyBuffer>()  // row_slots [cap]
                                  .Arg<ffi::AnyBuffer>()  // order [KB]: columns longest first
                                  .Ret<ffi::AnyBuffer>(),  // y [N..., K]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmBprop, jbs::BpropImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<ffi::AnyBuffer>()  // g [N..., K]
                                  .Arg<ffi::AnyBuffer>()  // w [cap, bs, bs]
                                  .Arg<ffi::AnyBuffer>()  // block_rows [cap]
                                  .Arg<ffi::AnyBuffer>()  // block_cols [cap]
                                  .Arg<ffi::AnyBuffer>()  // col_ptr [KB + 1]
                                  .Arg<ffi::AnyBuffer>()  // row_ptr [CB + 1]
                                  .Arg<ffi::AnyBuffer>()  // row_slots [cap]
                                  .Arg<ffi::AnyBuffer>()  // order [CB]: rows longest first
                                  .Ret<ffi::AnyBuffer>(),  // dx [N..., C]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JbsBsmmUpdat, jbs::UpdatImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<ffi::AnyBuffer>()  // x [N..., C]
                                  .Arg<ffi::AnyBuffer>()  // dy [N..., K]
                                  .Arg<ffi::AnyBuffer>()  // block_rows [cap]
                                  .Arg<ffi::AnyBuffer>()  // block_cols [cap]
                                  .Arg<ffi::AnyBuffer>()  // col_ptr [KB + 1]
                                  .Arg<ffi::AnyBuffer>()  // row_ptr [CB + 1] (unused)
                                  .Arg<ffi::AnyBuffer>()  // row_slots [cap] (unused)
                                  .Ret<ffi::AnyBuffer>(),  // dw [cap, bs, bs]
                              {ffi::Traits::kCmdBufferCompatible});
