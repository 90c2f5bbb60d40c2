// sm_90a SDD kernel (updat): dw[s] = x[:, rows(s)]^T @ dy[:, cols(s)], for 16-bit inputs
// and, on TF32 tensor cores, float32 inputs; blocks of 64 or 128 (blocks 8/16/32:
// bsmm_sm90_sdd_small.cuh, which shares the slot groups, the plan and the reduce kernel).
//
// Persistent and warp-specialized like the DSD kernel (bsmm_sm90_dsd.cuh). An item of
// the work plan (bsmm_work_plan.h) is a group of G consecutive slots and a range of the
// N reduction. The CTA keeps G accumulator tiles (BS x BS each, float32, in registers)
// and walks the range in k-steps of 32 rows; per step the producer loads, by TMA, the
// 32 x BS box of x for every slot of the group and the 32 x BS box of dy once per run of
// slots that share an output column (slots are stored column-major, so a group mostly
// shares one dy tile: it is read from global memory once for all of them). Both
// operands are MN-major in shared memory (x^T and dy, n contiguous), which 16-bit GMMA
// reads directly.
// TF32 (T = cutlass::tfloat32_t over float32 memory): TF32 GMMA reads K-major operands
// only, so the lowering passes x^T [C, n] and dy^T [K, n] (row-major, n contiguous, n
// padded with zero rows to a multiple of 4 for TMA's 16-byte strides) and the kernel
// reads both K-major with the same boxes, plan and epilogue. A k-step is still 32 rows
// of n (128 bytes of float32, one 128-byte swizzle row). Fewer stages fit in shared
// memory: 2 at BS 128, 3 at BS 64 (SddConfig::kStages).
//   warpgroup 0          producer (one elected thread)
//   warpgroups 1..BS/64  consumers, 64 rows of every slot's tile each
// When the plan splits N (fewer slot groups than two per SM), split s stores float32
// partials into workspace[s] and SddReduceKernel sums the splits in index order
// (deterministic) into dw; otherwise the tiles are stored into dw directly. Slots >= nnz
// and slots whose row/column is out of range are stored as zeros.
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_SDD_CUH_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_SDD_CUH_

#include "sm90/bsmm_sm90_common.cuh"

namespace jbs {
namespace sm90 {
namespace detail {

// Slots per item and rows per k-step at each block size (also used by SddWorkspaceBytes).
template <int BS>
struct SddShape {
  static constexpr int kGroup = SddGroupFor(BS);  // accumulators: 128 floats per consumer thread
  static constexpr int kTileK = SddTileKFor(BS);
};

template <typename T_, typename OutT_, int BS_>
struct SddConfig {
  using T = T_;
  using OutT = OutT_;
  static constexpr int kBs = BS_;
  static constexpr int kGroup = SddShape<BS_>::kGroup;
  static constexpr int kTileK = SddShape<BS_>::kTileK;
  // TF32: operands K-major (x^T, dy^T given by the lowering), twice the bytes per tile.
  static constexpr bool kKMajor = cute::is_same_v<T_, cutlass::tfloat32_t>;
  // Shared memory (<= 227 KB): 16-bit 4 stages; TF32 2 (BS 128: 192 KB) or 3 (BS 64: 208 KB).
  static constexpr int kStages = !kKMajor ? 4 : (BS_ == 128 ? 2 : 3);
  static constexpr int kConsumers = kBs / 64;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;

  using TileB = cute::Int<kBs>;
  using TileK = cute::Int<kTileK>;
  using Buffers = cute::Int<kGroup * kStages>;  // buffer stage * G + g

  using SmemAtom =
      cute::conditional_t<kKMajor, cute::GMMA::Layout_K_SW128_Atom<T>, cute::GMMA::Layout_MN_SW128_Atom<T>>;
  using SmemLayoutA = decltype(cute::tile_to_shape(SmemAtom{}, cute::make_shape(TileB{}, TileK{}, Buffers{})));
  using SmemLayoutB = SmemLayoutA;
  using SmemLayoutC =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<OutT>{}, cute::make_shape(TileB{}, TileB{})));
  using SmemLayoutW =
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{}, cute::make_shape(TileB{}, TileB{})));

  static constexpr cute::GMMA::Major kMajor = kKMajor ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using MmaOp =
      decltype(cute::GMMA::ss_op_selector<T, T, float, cute::Shape<cute::_64, TileB, TileK>, kMajor, kMajor>());
  using TiledMma =
      decltype(cute::make_tiled_mma(MmaOp{}, cute::Layout<cute::Shape<cute::Int<kConsumers>, cute::_1, cute::_1>>{}));

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<T, cute::cosize_v<SmemLayoutA>, 1024> a;
    cute::array_aligned<T, cute::cosize_v<SmemLayoutB>, 1024> b;
    cute::array_aligned<float, cute::cosize_v<SmemLayoutW>, 1024> c;  // OutT or float32 tile
    typename Pipeline::SharedStorage pipe;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA may have");
  // Operand buffers at multiples of 1024 bytes (the SW128 repeat; CheckTmaBox), mbarriers 8-byte aligned.
  static_assert(offsetof(SharedStorage, a) % 1024 == 0 && offsetof(SharedStorage, b) % 1024 == 0 &&
                    offsetof(SharedStorage, c) % 1024 == 0,
                "operand buffers off 1024-byte alignment");
  static_assert(offsetof(SharedStorage, pipe) % 8 == 0 && alignof(typename Pipeline::SharedStorage) >= 8,
                "mbarriers must be 8-byte aligned");
  static constexpr uint32_t kTileBytes = kBs * kTileK * sizeof(T);

  // x [n, cb * BS] as (M = cb * BS, K = n); dy [n, kb * BS] as (N = kb * BS, K = n).
  // TF32: x^T [cb * BS, n] and dy^T [kb * BS, n], the same (M|N, K) views K-major.
  static auto GlobalOperand(const T* ptr, int cols, int n) {
    if constexpr (kKMajor) {
      return cute::make_tensor(cute::make_gmem_ptr(ptr), cute::make_shape(cols, n),
                               cute::make_stride(static_cast<int64_t>(n), cute::_1{}));
    } else {
      return cute::make_tensor(cute::make_gmem_ptr(ptr), cute::make_shape(cols, n),
                               cute::make_stride(cute::_1{}, static_cast<int64_t>(cols)));
    }
  }
  // dw [cap, BS, BS] (or the workspace [splits * cap, BS, BS]) as rows x BS.
  template <typename E>
  static auto GlobalOut(E* ptr, int rows) {
    return cute::make_tensor(cute::make_gmem_ptr(ptr), cute::make_shape(rows, static_cast<int>(kBs)),
                             cute::make_stride(static_cast<int64_t>(kBs), cute::_1{}));
  }
  using TmaLoad = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GlobalOperand(nullptr, 0, 0),
                                               SmemLayoutA{}(cute::_, cute::_, 0)));
  using TmaC = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GlobalOut<OutT>(nullptr, 0), SmemLayoutC{}));
  using TmaW = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GlobalOut<float>(nullptr, 0), SmemLayoutW{}));
  static_assert(CheckTmaBox<T, TmaLoad, decltype(SmemLayoutA{}(cute::_, cute::_, 0)), SmemAtom>() &&
                CheckTmaBox<OutT, TmaC, SmemLayoutC, cute::GMMA::Layout_K_SW128_Atom<OutT>>() &&
                CheckTmaBox<float, TmaW, SmemLayoutW, cute::GMMA::Layout_K_SW128_Atom<float>>());
};

template <class Cfg>
struct SddArgs {
  SddParams p;
  plan::SddPlan plan;
  typename Cfg::TmaLoad tma_x;
  typename Cfg::TmaLoad tma_dy;
  typename Cfg::TmaC tma_c;  // into dw (splits == 1)
  typename Cfg::TmaW tma_w;  // into the workspace (splits > 1)
};

// The slots of an item, as the producer and the consumers both see them: whether a slot
// is computed, its input row and output column blocks, and which dy buffer of the stage
// it reads (the first slot of its run of equal columns).
template <int G>
struct SddGroup {
  int row[G];
  int col[G];
  int b_index[G];
  bool valid[G];
  int count;    // valid slots
  int b_tiles;  // distinct dy tiles loaded per k-step
};

template <int G>
__device__ __forceinline__ SddGroup<G> LoadSddGroup(const SddParams& p, int nnz, const plan::SddItem& item) {
  SddGroup<G> grp;
  grp.count = 0;
  grp.b_tiles = 0;
  int last_col = -1, last_b = 0;
  CUTE_UNROLL
  for (int g = 0; g < G; ++g) {
    const int s = item.slot_begin + g;
    grp.valid[g] = false;
    grp.row[g] = grp.col[g] = 0;
    grp.b_index[g] = 0;
    if (s < item.slot_end && s < nnz) {
      const int r = __ldg(p.block_rows + s);
      const int c = __ldg(p.block_cols + s);
      if (r >= 0 && r < p.cb && c >= 0 && c < p.kb) {
        grp.valid[g] = true;
        grp.row[g] = r;
        grp.col[g] = c;
        ++grp.count;
        if (c != last_col) {  // a new dy tile, loaded into buffer g
          last_col = c;
          last_b = g;
          ++grp.b_tiles;
        }
        grp.b_index[g] = last_b;
      }
    }
  }
  return grp;
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) SddSm90Kernel(const __grid_constant__ SddArgs<Cfg> args) {
  using namespace cute;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  constexpr int BS = Cfg::kBs;
  constexpr int G = Cfg::kGroup;
  constexpr int KS = Cfg::kTileK;
  constexpr bool kFloatOut = cute::is_same_v<typename Cfg::OutT, float>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const SddParams& p = args.p;
  const plan::SddPlan& pl = args.plan;

  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  const int warp_in_group = (threadIdx.x / 32) % 4;

  typename Pipeline::Params pipe_params;
  // One x tile is always loaded for an item with work; the rest of a step's bytes are
  // announced with producer_expect_transaction before its loads are issued.
  pipe_params.transaction_bytes = Cfg::kTileBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Cfg::kConsumers * kWarpgroupThreads;
  Pipeline pipeline(shared.pipe, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(args.tma_x.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_dy.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_c.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_w.get_tma_descriptor());
  }
  __syncthreads();

  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutA{});  // (BS, KS, buffer)
  Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutB{});
  const int n = static_cast<int>(p.n);
  const int nnz = Clamp(__ldg(p.nnz), 0, p.cap);
  const int64_t items = plan::SddNumItems(pl);

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (warp_in_group != 0 || !cute::elect_one_sync()) return;
    Tensor gX =
        local_tile(args.tma_x.get_tma_tensor(make_shape(p.cb * BS, n)),
                   Shape<typename Cfg::TileB, typename Cfg::TileK>{}, make_coord(_, _));  // (BS, KS, cb, k_tiles)
    Tensor gD =
        local_tile(args.tma_dy.get_tma_tensor(make_shape(p.kb * BS, n)),
                   Shape<typename Cfg::TileB, typename Cfg::TileK>{}, make_coord(_, _));  // (BS, KS, kb, k_tiles)
    auto [tXg, tXs] = tma_partition(args.tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gX));
    auto [tDg, tDs] = tma_partition(args.tma_dy, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gD));

    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
      const plan::SddItem item = plan::SddItemAt(pl, t);
      const SddGroup<G> grp = LoadSddGroup<G>(p, nnz, item);
      if (grp.count == 0) continue;
      const int k_begin = static_cast<int>(item.n_begin / KS);
      const int k_end = static_cast<int>((item.n_end + KS - 1) / KS);
      const uint32_t extra = static_cast<uint32_t>(grp.count - 1 + grp.b_tiles) * Cfg::kTileBytes;
      for (int k = k_begin; k < k_end; ++k) {
        pipeline.producer_acquire(state);  // expects one tile's bytes
        if (extra != 0) pipeline.producer_expect_transaction(state, extra);
        auto* barrier = pipeline.producer_get_barrier(state);
        const int base = state.index() * G;
        CUTE_UNROLL
        for (int g = 0; g < G; ++g) {
          if (!grp.valid[g]) continue;
          copy(args.tma_x.with(*barrier), tXg(_, grp.row[g], k), tXs(_, base + g));
          if (grp.b_index[g] == g) copy(args.tma_dy.with(*barrier), tDg(_, grp.col[g], k), tDs(_, base + g));
        }
        ++state;
      }
    }
    pipeline.producer_tail(state);
    return;
  }

  // Consumers.
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int ctid = threadIdx.x - kWarpgroupThreads;
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(ctid);
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, M, K, buffer)
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  using Accum = decltype(partition_fragment_C(mma, Shape<typename Cfg::TileB, typename Cfg::TileB>{}));
  Accum accum[G];

  Tensor sC =
      make_tensor(make_smem_ptr(reinterpret_cast<typename Cfg::OutT*>(shared.c.data())), typename Cfg::SmemLayoutC{});
  Tensor sW = make_tensor(make_smem_ptr(shared.c.data()), typename Cfg::SmemLayoutW{});
  Tensor tCsC = thr_mma.partition_C(sC);
  Tensor tCsW = thr_mma.partition_C(sW);
  const bool split = pl.splits > 1;
  Tensor gC = local_tile(args.tma_c.get_tma_tensor(make_shape(p.cap * BS, BS)),
                         Shape<typename Cfg::TileB, typename Cfg::TileB>{}, make_coord(_, _));
  Tensor gW = local_tile(args.tma_w.get_tma_tensor(make_shape(pl.splits * p.cap * BS, BS)),
                         Shape<typename Cfg::TileB, typename Cfg::TileB>{}, make_coord(_, _));
  auto tma_c_thr = args.tma_c.get_slice(0);
  auto tma_w_thr = args.tma_w.get_slice(0);
  const bool store_thread = ctid == 0;

  PipelineState read_state;
  PipelineState release_state;
  for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
    const plan::SddItem item = plan::SddItemAt(pl, t);
    const SddGroup<G> grp = LoadSddGroup<G>(p, nnz, item);
    const int k_begin = static_cast<int>(item.n_begin / KS);
    const int k_end = grp.count == 0 ? k_begin : static_cast<int>((item.n_end + KS - 1) / KS);
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int in_flight = 0;
    for (int k = k_begin; k < k_end; ++k) {
      pipeline.consumer_wait(read_state);
      const int base = read_state.index() * G;
      CUTE_UNROLL
      for (int g = 0; g < G; ++g) warpgroup_fence_operand(accum[g]);
      warpgroup_arrive();
      // Every valid slot: one GMMA per k16 block. accumulate_ is Zero only on the
      // first k-step of the item, for every slot alike.
      const GMMA::ScaleOut scale = k == k_begin ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      CUTE_UNROLL
      for (int g = 0; g < G; ++g) {
        // Slots without work run too (on whatever their buffers hold) so that every
        // k-step issues the same GMMA sequence; their tiles are cleared before storing.
        mma.accumulate_ = scale;
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          gemm(mma, tCrA(_, _, kb, base + g), tCrB(_, _, kb, base + grp.b_index[g]), accum[g]);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      CUTE_UNROLL
      for (int g = 0; g < G; ++g) warpgroup_fence_operand(accum[g]);
      if (in_flight) {
        pipeline.consumer_release(release_state);
        ++release_state;
      }
      in_flight = 1;
      ++read_state;
    }
    warpgroup_wait<0>();
    CUTE_UNROLL
    for (int g = 0; g < G; ++g) warpgroup_fence_operand(accum[g]);
    if (in_flight) {
      pipeline.consumer_release(release_state);
      ++release_state;
    }

    // Epilogue, one slot at a time through the shared tile. Slots without work (no
    // k-step, padding, out-of-range blocks) store zeros.
    CUTE_UNROLL
    for (int g = 0; g < G; ++g) {
      const int slot = item.slot_begin + g;
      if (slot >= item.slot_end) continue;  // uniform: the last group may be short
      if (!grp.valid[g] || k_end == k_begin) clear(accum[g]);
      if (store_thread) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(Cfg::kConsumers * kWarpgroupThreads, kEpilogueBarrier);
      // A float32 output has the workspace's shared layout: one conversion path only.
      if (kFloatOut || split) {
        StoreAccum(accum[g], tCsW);
      } else {
        StoreAccum(accum[g], tCsC);
      }
      tma_store_fence();
      cutlass::arch::NamedBarrier::sync(Cfg::kConsumers * kWarpgroupThreads, kEpilogueBarrier);
      if (store_thread) {
        if (split) {
          copy(args.tma_w, tma_w_thr.partition_S(sW), tma_w_thr.partition_D(gW(_, _, item.split * p.cap + slot, 0)));
        } else {
          copy(args.tma_c, tma_c_thr.partition_S(sC), tma_c_thr.partition_D(gC(_, _, slot, 0)));
        }
        tma_store_arrive();
      }
    }
  }
  if (store_thread) tma_store_wait<0>();
}

// Second pass of a split updat: dw[e] = sum over splits s (in order) of ws[s][e], and 0
// for slots >= nnz. Four elements per thread (BS * BS is a multiple of 4).
template <typename OutT>
__global__ void SddReduceKernel(const float* __restrict__ ws, OutT* __restrict__ dw,
                                const int32_t* __restrict__ nnz_ptr, int splits, int cap, int block_elems) {
  const int64_t total4 = static_cast<int64_t>(cap) * block_elems / 4;
  const int64_t split_stride = static_cast<int64_t>(cap) * block_elems;
  const int nnz = Clamp(__ldg(nnz_ptr), 0, cap);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (e / block_elems < nnz) {
      for (int s = 0; s < splits; ++s) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(ws + s * split_stride + e));
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
    }
    dw[e] = static_cast<OutT>(acc.x);
    dw[e + 1] = static_cast<OutT>(acc.y);
    dw[e + 2] = static_cast<OutT>(acc.z);
    dw[e + 3] = static_cast<OutT>(acc.w);
  }
}
constexpr int kReduceThreads = 256;

// The second pass of a split updat (every SDD kernel): about 8 CTAs per SM.
template <typename OutT>
cudaError_t LaunchSddReduce(void (*reduce)(const float*, OutT*, const int32_t*, int, int, int), const float* ws,
                            const SddParams& p, int splits, int bs, const Launch& launch) {
  const int64_t total4 = static_cast<int64_t>(p.cap) * bs * bs / 4;
  const int blocks = static_cast<int>(plan::Min64(plan::CeilDiv(total4, kReduceThreads), int64_t{launch.num_sms} * 8));
  const int grid = blocks > 0 ? blocks : 1;
  reduce<<<grid, kReduceThreads, 0, launch.stream>>>(ws, static_cast<OutT*>(p.dw), p.nnz, splits, p.cap, bs * bs);
  return cudaGetLastError();
}

template <int BS>
plan::SddPlan SddPlanFor(const SddParams& p, int num_sms) {
  return plan::MakeSddPlan(p.cap, SddShape<BS>::kGroup, p.n, SddShape<BS>::kTileK, num_sms > 0 ? num_sms : 1);
}

template <class Cfg>
cudaError_t LaunchSddConfig(const SddParams& p, const Launch& launch) {
  using T = typename Cfg::T;
  using OutT = typename Cfg::OutT;
  auto kernel = &SddSm90Kernel<Cfg>;
  auto reduce = &SddReduceKernel<OutT>;
  if (launch.prepare_only) return PrepareKernel(kernel, Cfg::kSmemBytes, reduce);
  const plan::SddPlan pl = SddPlanFor<Cfg::kBs>(p, launch.plan_sms > 0 ? launch.plan_sms : launch.num_sms);
  const int64_t ws_rows = static_cast<int64_t>(pl.splits) * p.cap * Cfg::kBs;
  if (p.n > INT32_MAX || ws_rows > INT32_MAX || static_cast<int64_t>(p.cb) * Cfg::kBs > INT32_MAX ||
      static_cast<int64_t>(p.kb) * Cfg::kBs > INT32_MAX) {
    return cudaErrorInvalidValue;  // TMA coordinates are 32-bit
  }
  float* ws = static_cast<float*>(launch.workspace);
  if (pl.splits > 1 && ws == nullptr) return cudaErrorInvalidValue;
  const int n = static_cast<int>(p.n);
  // Without a split the workspace descriptor is never used; it points at dw (any valid
  // address) so that it can still be encoded.
  float* ws_desc = pl.splits > 1 ? ws : static_cast<float*>(p.dw);
  SddArgs<Cfg> args{
      p,
      pl,
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalOperand(static_cast<const T*>(p.x), p.cb * Cfg::kBs, n),
                          typename Cfg::SmemLayoutA{}(cute::_, cute::_, 0)),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalOperand(static_cast<const T*>(p.dy), p.kb * Cfg::kBs, n),
                          typename Cfg::SmemLayoutB{}(cute::_, cute::_, 0)),
      cute::make_tma_copy(cute::SM90_TMA_STORE{},
                          Cfg::template GlobalOut<OutT>(static_cast<OutT*>(p.dw), p.cap * Cfg::kBs),
                          typename Cfg::SmemLayoutC{}),
      cute::make_tma_copy(
          cute::SM90_TMA_STORE{},
          Cfg::template GlobalOut<float>(ws_desc, static_cast<int>(pl.splits > 1 ? ws_rows : p.cap * Cfg::kBs)),
          typename Cfg::SmemLayoutW{})};
  const int grid = plan::PersistentGrid(plan::SddNumItems(pl), launch.num_sms > 0 ? launch.num_sms : 1, 1);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, launch.stream>>>(args);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || pl.splits == 1) return err;
  return LaunchSddReduce<OutT>(reduce, ws, p, pl.splits, Cfg::kBs, launch);
}

// float32 inputs on TF32 GMMA (x and dy given transposed, see the top of this file),
// float32 output. A template (T: same bits as float32) so that only the translation unit
// that calls it compiles the TF32 kernels.
template <typename T = cutlass::tfloat32_t>
cudaError_t DispatchSddTF32(const SddParams& p, const Launch& launch) {
  switch (p.bs) {
    case 64: return LaunchSddConfig<SddConfig<T, float, 64>>(p, launch);
    case 128: return LaunchSddConfig<SddConfig<T, float, 128>>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, typename OutT>
cudaError_t DispatchSdd(const SddParams& p, const Launch& launch) {
  switch (p.bs) {
    case 64: return LaunchSddConfig<SddConfig<T, OutT, 64>>(p, launch);
    case 128: return LaunchSddConfig<SddConfig<T, OutT, 128>>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_SDD_CUH_
