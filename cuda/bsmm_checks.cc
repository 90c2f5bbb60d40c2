// Argument checks shared by the CPU and CUDA bsmm handlers (see bsmm_checks.h).
#include "bsmm_checks.h"

#include <cstdint>
#include <sstream>
#include <string>

namespace ffi = xla::ffi;

namespace jbs {

std::string ShapeStr(const ffi::AnyBuffer& b) {
  std::ostringstream os;
  os << "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

std::string Operands::str() const {
  std::string s;
  for (int i = 0; i < 3; ++i) s += std::string(i ? ", " : "") + names[i] + " " + ShapeStr(*buffers[i]);
  return s;
}

Operands DescribeDsd(const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& w, const ffi::AnyBuffer& out) {
  return Operands{{"lhs", "w", "out"}, {&lhs, &w, &out}};
}

Operands DescribeSdd(const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& dw) {
  return Operands{{"x", "dy", "dw"}, {&x, &dy, &dw}};
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

namespace {

bool ToDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    default: return false;
  }
}

}  // namespace

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

namespace {

// Product of all dims but the last (the number of rows), and the last dim.
void RowsAndFeatures(const ffi::AnyBuffer& b, int64_t* rows, int64_t* features) {
  auto dims = b.dimensions();
  int64_t n = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) n *= dims[i];
  *rows = n;
  *features = dims.size() == 0 ? 0 : dims[dims.size() - 1];
}

}  // namespace

ffi::Error CheckTables(const char* op, const ffi::AnyBuffer& block_rows, const ffi::AnyBuffer& block_cols,
                       const ffi::AnyBuffer& col_ptr, const ffi::AnyBuffer& row_ptr, const ffi::AnyBuffer& row_slots,
                       Tables* t) {
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
    return Invalid(
        op, "col_ptr and row_ptr need at least one entry, got " + ShapeStr(col_ptr) + " and " + ShapeStr(row_ptr));
  }
  if (block_cols.dimensions()[0] != t->cap || row_slots.dimensions()[0] != t->cap) {
    return Invalid(op, "block_rows, block_cols and row_slots must all be [capacity], got " + ShapeStr(block_rows) +
                           ", " + ShapeStr(block_cols) + ", " + ShapeStr(row_slots));
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

ffi::Error CheckDtypes(const char* op, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& out,
                       KernelDtypes* dtypes) {
  if (!ToDType(a.element_type(), &dtypes->in) || a.element_type() != b.element_type()) {
    return Invalid(op, std::string("inputs must share one dtype among float32, float16, bfloat16, got ") +
                           DtypeName(a.element_type()) + " " + ShapeStr(a) + " and " + DtypeName(b.element_type()) +
                           " " + ShapeStr(b));
  }
  if (out.element_type() != a.element_type() && out.element_type() != ffi::DataType::F32) {
    return Invalid(op, std::string("output dtype must be the input dtype or float32, got ") +
                           DtypeName(out.element_type()) + " for " + DtypeName(a.element_type()) + " inputs");
  }
  dtypes->out_f32 = out.element_type() == ffi::DataType::F32;
  return ffi::Error::Success();
}

namespace {

// w (or dw) must be [cap, bs, bs] with a supported bs; returns bs through `bs`.
ffi::Error CheckBlocks(const char* op, const char* name, const ffi::AnyBuffer& w, int64_t cap, const Operands& shapes,
                       int64_t* bs) {
  auto wd = w.dimensions();
  if (wd.size() != 3 || wd[0] != cap || wd[1] != wd[2] || !SupportedBlockSize(wd[2])) {
    return Invalid(op, std::string(name) + " must be [capacity=" + std::to_string(cap) + ", bs, bs] with bs in " +
                           kBlockSizesText + "; got " + shapes.str());
  }
  *bs = wd[2];
  return ffi::Error::Success();
}

// a and b have the same rank >= 1 and share every dim but the last.
ffi::Error CheckLeadingDims(const char* op, const char* a_name, const ffi::AnyBuffer& a, const char* b_name,
                            const ffi::AnyBuffer& b, const Operands& shapes) {
  auto ad = a.dimensions();
  auto bd = b.dimensions();
  if (ad.size() < 1 || ad.size() != bd.size()) {
    return Invalid(op, std::string(a_name) + " and " + b_name + " must have the same rank >= 1; got " + shapes.str());
  }
  for (size_t i = 0; i + 1 < ad.size(); ++i) {
    if (ad[i] != bd[i])
      return Invalid(op, std::string(a_name) + " and " + b_name + " must share leading dims; got " + shapes.str());
  }
  return ffi::Error::Success();
}

}  // namespace

std::string GridStr(const Tables& t, int64_t bs) {
  return "a layout grid (" + std::to_string(t.cb) + ", " + std::to_string(t.kb) + ") of block " + std::to_string(bs);
}

ffi::Error CheckDsd(const char* op, bool transpose, const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& w,
                    const ffi::AnyBuffer& block_rows, const ffi::AnyBuffer& block_cols, const ffi::AnyBuffer& col_ptr,
                    const ffi::AnyBuffer& row_ptr, const ffi::AnyBuffer& row_slots, const ffi::AnyBuffer& order,
                    ffi::AnyBuffer& out, KernelDtypes* dtypes, DsdParams* p) {
  const Operands shapes = DescribeDsd(lhs, w, out);  // formatted only for an error
  Tables t;
  if (ffi::Error e = CheckTables(op, block_rows, block_cols, col_ptr, row_ptr, row_slots, &t); e.failure()) return e;
  if (ffi::Error e = CheckDtypes(op, lhs, w, out, dtypes); e.failure()) return e;
  int64_t bs;
  if (ffi::Error e = CheckBlocks(op, "w", w, t.cap, shapes, &bs); e.failure()) return e;
  if (ffi::Error e = CheckLeadingDims(op, "lhs", lhs, "out", out, shapes); e.failure()) return e;
  const int64_t nin = transpose ? t.kb : t.cb;
  const int64_t nseg = transpose ? t.cb : t.kb;
  int64_t n, fin, n_out, fout;
  RowsAndFeatures(lhs, &n, &fin);
  RowsAndFeatures(out, &n_out, &fout);
  if (fin != nin * bs || fout != nseg * bs) {
    return Invalid(op, "need lhs [..., " + std::to_string(nin * bs) + "] and out [..., " + std::to_string(nseg * bs) +
                           "] for " + GridStr(t, bs) + "; got " + shapes.str());
  }
  if (order.element_type() != ffi::DataType::S32 || order.dimensions().size() != 1 || order.dimensions()[0] != nseg) {
    return Invalid(op, "order must be int32 [" + std::to_string(nseg) + "], got " + DtypeName(order.element_type()) +
                           " " + ShapeStr(order));
  }
  p->a = lhs.untyped_data();
  p->w = w.untyped_data();
  p->out = out.untyped_data();
  p->seg_ptr = transpose ? t.row_ptr : t.col_ptr;
  p->seg_slots = transpose ? t.row_slots : nullptr;
  p->in_block = transpose ? t.block_cols : t.block_rows;
  p->order = static_cast<const int32_t*>(order.untyped_data());
  p->nnz = t.col_ptr + t.kb;  // col_ptr[KB] == nnz
  p->work = nullptr;          // CheckWorkList, for the targets that take it
  p->work_ptr = nullptr;
  p->n = n;
  p->nin = static_cast<int>(nin);
  p->nseg = static_cast<int>(nseg);
  p->cap = static_cast<int>(t.cap);
  p->bs = static_cast<int>(bs);
  return ffi::Error::Success();
}

ffi::Error CheckWorkList(const char* op, const ffi::AnyBuffer& work, const ffi::AnyBuffer& work_ptr, DsdParams* p) {
  const int64_t pairs = 2 * int64_t{p->cap};
  if (work.element_type() != ffi::DataType::S32 || work.dimensions().size() != 1 || work.dimensions()[0] != pairs) {
    return Invalid(op, "work (the layout's col_work / row_work) must be int32 [" + std::to_string(pairs) +
                           "] (2 x capacity " + std::to_string(p->cap) + "), got " + DtypeName(work.element_type()) +
                           " " + ShapeStr(work));
  }
  const int64_t ptrs = int64_t{p->nseg} + 1;
  if (work_ptr.element_type() != ffi::DataType::S32 || work_ptr.dimensions().size() != 1 ||
      work_ptr.dimensions()[0] != ptrs) {
    return Invalid(op, "work_ptr (the layout's col_work_ptr / row_work_ptr) must be int32 [" + std::to_string(ptrs) +
                           "] (outputs + 1), got " + DtypeName(work_ptr.element_type()) + " " + ShapeStr(work_ptr));
  }
  p->work = static_cast<const int32_t*>(work.untyped_data());
  p->work_ptr = static_cast<const int32_t*>(work_ptr.untyped_data());
  return ffi::Error::Success();
}

ffi::Error CheckSdd(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& block_rows,
                    const ffi::AnyBuffer& block_cols, const ffi::AnyBuffer& col_ptr, const ffi::AnyBuffer& row_ptr,
                    const ffi::AnyBuffer& row_slots, ffi::AnyBuffer& dw, KernelDtypes* dtypes, SddParams* p) {
  const Operands shapes = DescribeSdd(x, dy, dw);  // formatted only for an error
  Tables t;
  if (ffi::Error e = CheckTables(op, block_rows, block_cols, col_ptr, row_ptr, row_slots, &t); e.failure()) return e;
  if (ffi::Error e = CheckDtypes(op, x, dy, dw, dtypes); e.failure()) return e;
  int64_t bs;
  if (ffi::Error e = CheckBlocks(op, "dw", dw, t.cap, shapes, &bs); e.failure()) return e;
  if (ffi::Error e = CheckLeadingDims(op, "x", x, "dy", dy, shapes); e.failure()) return e;
  int64_t n, c, n2, k;
  RowsAndFeatures(x, &n, &c);
  RowsAndFeatures(dy, &n2, &k);
  if (c != t.cb * bs || k != t.kb * bs) {
    return Invalid(op, "need x [..., " + std::to_string(t.cb * bs) + "] and dy [..., " + std::to_string(t.kb * bs) +
                           "] for " + GridStr(t, bs) + "; got " + shapes.str());
  }
  p->x = x.untyped_data();
  p->dy = dy.untyped_data();
  p->dw = dw.untyped_data();
  p->block_rows = t.block_rows;
  p->block_cols = t.block_cols;
  p->nnz = t.col_ptr + t.kb;
  p->n = n;  // n == 0 is fine: the kernels store zeros
  p->cb = static_cast<int>(t.cb);
  p->kb = static_cast<int>(t.kb);
  p->cap = static_cast<int>(t.cap);
  p->bs = static_cast<int>(bs);
  return ffi::Error::Success();
}

}  // namespace jbs
