// sm_90a SDD kernel (updat) for 16-bit inputs, or float32 inputs on TF32 GMMA, at blocks
// 8, 16 and 32: dw[s] = x[:, rows(s)]^T @ dy[:, cols(s)], float32 accumulation.
//
// A BS x BS product is far below wgmma's 64-row M, so an item of the work plan
// (bsmm_work_plan.h, group G = 64 / BS consecutive slots, a range of the N reduction)
// stacks the x^T slices of its G slots along M: per k-step of 64 rows of n the producer
// (SddProduce, SddSm90Kernel's producer) loads by TMA the 64 x BS box of x of every
// valid slot into slice g of a 64-row A tile, and the 64 x BS box of dy once per run of
// slots that share an output column (slots are stored column-major, so most items are a
// single run). One GMMA 64 x BS x 16 per k16 block and run then gives every slot of the
// run at once: row group g of run r's [64, BS] accumulator is slot g's block when slot g
// belongs to run r (the other row groups are discarded; rows of a product only depend on
// the rows of A, so a stale slice never leaks into another slot).
//   warpgroup 0   producer (one elected thread)
//   warpgroup 1   consumer: G accumulators of 64 x BS (32 floats per thread in all)
// The epilogue assembles the G blocks ([G * BS, BS] row-major, the layout of G
// consecutive slots of dw) in shared memory and the consumers copy them out with 16-byte
// stores: into dw (the input dtype or float32), or, when the plan splits N, as float32
// partials into workspace[split] for SddReduceKernel (bsmm_sm90_sdd.cuh). Slots >= nnz,
// slots with an out-of-range row/column and slots of an empty range are zeros.
//
// Shared memory: A and B as (BS, 64, stages * G) boxes in MN-major atoms whose swizzle
// row is BS elements (16/32/64 bytes: INTER/SW32/SW64), each box one contiguous atom
// tiling; the GMMA view of A, (64, 64, stages), tiles the same atoms K first, so that M
// rows [g * BS, (g + 1) * BS) are box g.
//
// TF32 (T = tfloat32_t, DispatchSddSmallTF32): TF32 GMMA reads both operands K-major only,
// so x and dy come as x^T [cb * BS, n] and dy^T [kb * BS, n] (the lowering transposes
// them, n padded to a multiple of 4). The k-step stays 64 rows of n (same plan and
// workspace as 16-bit), but a K-major 128-byte swizzle row holds 32 floats: each slot's
// [BS, 64] tile is two [BS, 32] boxes (half h of box g of a stage at buffer
// (stage * 2 + h) * G + g), and the GMMA view of A, (64, 64, stages), tiles the K-major
// SW128 atoms M first, so that those buffers are its (rows of g, K half h) pieces. 6
// stages (twice the bytes per stage).
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_SDD_SMALL_CUH_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_SDD_SMALL_CUH_

#include "sm90/bsmm_sm90_sdd.cuh"

namespace jbs {
namespace sm90 {
namespace detail {

// The producer (one elected thread), the one of SddSm90Kernel as a function: for every item of this CTA with
// work, per k-step, the KS x BS tile of x of every valid slot into buffers
// (stage * KH + h) * G + g (h < KH: the tile's KH boxes along K) of sA and the tile of dy
// once per run of equal columns (at its first slot's index) into sB. sA, sB:
// (BS, KS / KH, stages * KH * G) views of the TMA boxes. A stage expects one slot tile
// (the pipeline's transaction bytes, `tile_bytes`); the rest is announced before any load
// is issued.
template <int G, int BS, int KS, int KH, class Pipeline, class TmaLoad, class SmemA, class SmemB>
__device__ __forceinline__ void SddProduce(Pipeline& pipeline, const TmaLoad& tma_x, const TmaLoad& tma_dy, SmemA& sA,
                                           SmemB& sB, const SddParams& p, const plan::SddPlan& pl, int nnz,
                                           uint32_t tile_bytes) {
  using namespace cute;
  const int n = static_cast<int>(p.n);
  const int64_t items = plan::SddNumItems(pl);
  static_assert(KS % KH == 0, "a tile is KH whole boxes");
  Tensor gX = local_tile(tma_x.get_tma_tensor(make_shape(p.cb * BS, n)), Shape<Int<BS>, Int<KS / KH>>{},
                         make_coord(_, _));  // (BS, KS / KH, cb, k_tiles * KH)
  Tensor gD = local_tile(tma_dy.get_tma_tensor(make_shape(p.kb * BS, n)), Shape<Int<BS>, Int<KS / KH>>{},
                         make_coord(_, _));  // (BS, KS / KH, kb, k_tiles * KH)
  auto [tXg, tXs] = tma_partition(tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gX));
  auto [tDg, tDs] = tma_partition(tma_dy, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gD));

  auto state = cutlass::make_producer_start_state<Pipeline>();
  for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
    const plan::SddItem item = plan::SddItemAt(pl, t);
    const SddGroup<G> grp = LoadSddGroup<G>(p, nnz, item);
    if (grp.count == 0) continue;
    const int k_begin = static_cast<int>(item.n_begin / KS);
    const int k_end = static_cast<int>((item.n_end + KS - 1) / KS);
    const uint32_t extra = static_cast<uint32_t>(grp.count - 1 + grp.b_tiles) * tile_bytes;
    for (int k = k_begin; k < k_end; ++k) {
      pipeline.producer_acquire(state);  // expects one tile's bytes
      if (extra != 0) pipeline.producer_expect_transaction(state, extra);
      auto* barrier = pipeline.producer_get_barrier(state);
      CUTE_UNROLL
      for (int h = 0; h < KH; ++h) {
        const int base = (state.index() * KH + h) * G;
        CUTE_UNROLL
        for (int g = 0; g < G; ++g) {
          if (!grp.valid[g]) continue;
          copy(tma_x.with(*barrier), tXg(_, grp.row[g], k * KH + h), tXs(_, base + g));
          if (grp.b_index[g] == g) copy(tma_dy.with(*barrier), tDg(_, grp.col[g], k * KH + h), tDs(_, base + g));
        }
      }
      ++state;
    }
  }
  pipeline.producer_tail(state);
}

template <typename T_, typename OutT_, int BS_>
struct SddSmallConfig {
  using T = T_;
  using OutT = OutT_;
  static constexpr int kBs = BS_;
  static constexpr int kGroup = SddShape<BS_>::kGroup;  // 64 / BS slots stacked along M
  static constexpr int kTileK = SddShape<BS_>::kTileK;
  static constexpr int kTileM = 64;
  static constexpr bool kKMajor = sizeof(T) == 4;  // TF32: x^T and dy^T, read K-major
  static constexpr int kStages = kKMajor ? 6 : 8;
  static constexpr int kBoxK = kKMajor ? 32 : kTileK;  // rows of n per TMA box (TF32: one 128-byte swizzle row)
  static constexpr int kBoxesK = kTileK / kBoxK;       // boxes per slot tile
  static constexpr int kBoxKBlocks = kBoxK * static_cast<int>(sizeof(T)) / 32;  // GMMA k-blocks (32 bytes) per box
  static constexpr int kConsumers = 1;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  static_assert(kGroup * kBs == kTileM, "the slots of an item fill wgmma's M = 64");
  static_assert(kBoxesK * kBoxK == kTileK, "a slot tile is whole boxes");
  static constexpr cute::GMMA::Major kMajor = kKMajor ? cute::GMMA::Major::K : cute::GMMA::Major::MN;

  using Bs = cute::Int<kBs>;
  using BoxK = cute::Int<kBoxK>;
  using TileK = cute::Int<kTileK>;
  using TileM = cute::Int<kTileM>;
  using Atom = cute::conditional_t<kKMajor, cute::GMMA::Layout_K_SW128_Atom<T>, AtomFor<T, cute::GMMA::Major::MN, kBs>>;
  // TMA view: box q = (stage * kBoxesK + h) * G + g.
  using SmemLayoutBoxes =
      decltype(cute::tile_to_shape(Atom{}, cute::make_shape(Bs{}, BoxK{}, cute::Int<kStages * kBoxesK * kGroup>{})));
  // GMMA view of A: a stage's G boxes stacked along M (MN-major atoms tiled K first; the
  // K-major TF32 atoms tiled M first, so that K half h follows the G boxes of half h - 1).
  using SmemLayoutA = cute::conditional_t<
      kKMajor, decltype(cute::tile_to_shape(Atom{}, cute::make_shape(TileM{}, TileK{}, cute::Int<kStages>{}))),
      decltype(cute::tile_to_shape(Atom{}, cute::make_shape(TileM{}, TileK{}, cute::Int<kStages>{}),
                                   cute::Step<cute::_2, cute::_1, cute::_3>{}))>;
  static_assert(cute::cosize_v<SmemLayoutA> == cute::cosize_v<SmemLayoutBoxes>, "the two views of A differ in size");

  using MmaOp = decltype(cute::GMMA::ss_op_selector<T, T, float, cute::Shape<TileM, Bs, TileK>, kMajor, kMajor>());
  using TiledMma = decltype(cute::make_tiled_mma(MmaOp{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<T, cute::cosize_v<SmemLayoutBoxes>, 1024> a;
    cute::array_aligned<T, cute::cosize_v<SmemLayoutBoxes>, 1024> b;
    cute::array_aligned<float, kTileM * kBs, 128> c;  // [G * BS, BS] row-major, OutT or float32
    typename Pipeline::SharedStorage pipe;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an sm_90 CTA may have");
  // Operand buffers at multiples of 1024 bytes (CheckTmaBox), the epilogue tile 16-byte
  // aligned (16-byte stores), mbarriers 8-byte aligned.
  static_assert(offsetof(SharedStorage, a) % 1024 == 0 && offsetof(SharedStorage, b) % 1024 == 0,
                "operand buffers off 1024-byte alignment");
  static_assert(offsetof(SharedStorage, c) % 16 == 0, "epilogue tile off 16-byte alignment");
  static_assert(offsetof(SharedStorage, pipe) % 8 == 0 && alignof(typename Pipeline::SharedStorage) >= 8,
                "mbarriers must be 8-byte aligned");
  static constexpr uint32_t kTileBytes = kBs * kTileK * sizeof(T);

  // x [n, cb * BS] as (M = cb * BS, K = n); dy [n, kb * BS] as (N = kb * BS, K = n).
  // TF32: x^T [cb * BS, n] and dy^T [kb * BS, n], the same (M or N, K) views K-major.
  static auto GlobalOperand(const T* ptr, int cols, int n) {
    if constexpr (kKMajor) {
      return cute::make_tensor(cute::make_gmem_ptr(ptr), cute::make_shape(cols, n),
                               cute::make_stride(static_cast<int64_t>(n), cute::_1{}));
    } else {
      return cute::make_tensor(cute::make_gmem_ptr(ptr), cute::make_shape(cols, n),
                               cute::make_stride(cute::_1{}, static_cast<int64_t>(cols)));
    }
  }
  using TmaLoad = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GlobalOperand(nullptr, 0, 0),
                                               SmemLayoutBoxes{}(cute::_, cute::_, 0)));
  static_assert(CheckTmaBox<T, TmaLoad, decltype(SmemLayoutBoxes{}(cute::_, cute::_, 0)), Atom>());
};

template <class Cfg>
struct SddSmallArgs {
  SddParams p;
  plan::SddPlan plan;
  typename Cfg::TmaLoad tma_x;
  typename Cfg::TmaLoad tma_dy;
  float* workspace;  // [splits, cap, BS, BS] when plan.splits > 1
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) SddSmallSm90Kernel(const __grid_constant__ SddSmallArgs<Cfg> args) {
  using namespace cute;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  using OutT = typename Cfg::OutT;
  constexpr int BS = Cfg::kBs;
  constexpr int G = Cfg::kGroup;
  constexpr int KS = Cfg::kTileK;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const SddParams& p = args.p;
  const plan::SddPlan& pl = args.plan;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  const int warp_in_group = (threadIdx.x / 32) % 4;

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kTileBytes;  // the rest: producer_expect_transaction (SddProduce)
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Cfg::kConsumers * kWarpgroupThreads;
  Pipeline pipeline(shared.pipe, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(args.tma_x.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_dy.get_tma_descriptor());
  }
  __syncthreads();

  const int nnz = Clamp(__ldg(p.nnz), 0, p.cap);
  const int64_t items = plan::SddNumItems(pl);

  if (warpgroup == 0) {
    // No register reallocation: two warpgroups fit in the register file at the
    // 255-register cap, and the producer's G-slot bookkeeping needs more than 40.
    if (warp_in_group != 0 || !cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutBoxes{});  // (BS, box K, box)
    Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutBoxes{});
    SddProduce<G, BS, KS, Cfg::kBoxesK>(pipeline, args.tma_x, args.tma_dy, sA, sB, p, pl, nnz, Cfg::kTileBytes);
    return;
  }

  // Consumer warpgroup.
  const int ctid = threadIdx.x - kWarpgroupThreads;
  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutA{});      // (64, KS, stage)
  Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutBoxes{});  // (BS, box K, box)
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(ctid);
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, 1, k-blocks per tile, stage)
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));  // (MMA, 1, k-blocks per box, box)
  constexpr int KB = Cfg::kBoxKBlocks;
  static_assert(decltype(size<2>(tCrB))::value == KB, "k-blocks per box");
  static_assert(decltype(size<2>(tCrA))::value == KB * Cfg::kBoxesK, "k-blocks per tile");
  using Accum = decltype(partition_fragment_C(mma, Shape<typename Cfg::TileM, typename Cfg::Bs>{}));
  Accum accum[G];  // accum[h]: the run whose first slot is h
  // (row, column) of every accumulator element in the [64, BS] tile.
  Tensor tCc = thr_mma.partition_C(make_identity_tensor(Shape<typename Cfg::TileM, typename Cfg::Bs>{}));
  const bool split = pl.splits > 1;
  const bool float_out = split || cute::is_same_v<OutT, float>;
  float* tile_f = shared.c.data();
  OutT* tile_o = reinterpret_cast<OutT*>(shared.c.data());

  PipelineState read_state;
  PipelineState release_state;
  for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
    const plan::SddItem item = plan::SddItemAt(pl, t);
    const SddGroup<G> grp = LoadSddGroup<G>(p, nnz, item);
    const int k_begin = static_cast<int>(item.n_begin / KS);
    const int k_end = grp.count == 0 ? k_begin : static_cast<int>((item.n_end + KS - 1) / KS);
    // Run heads (a bit per first slot of a run) and, per head h, the slots of its run.
    uint32_t heads = 0;
    uint32_t members[G];
    CUTE_UNROLL
    for (int h = 0; h < G; ++h) {
      members[h] = 0;
      CUTE_UNROLL
      for (int g = 0; g < G; ++g) {
        if (grp.valid[g] && grp.b_index[g] == h) members[h] |= 1u << g;
      }
      if (members[h] != 0) heads |= 1u << h;
    }
    if (k_end == k_begin) {  // nothing computed: every slot stores zeros
      heads = 0;
      CUTE_UNROLL
      for (int h = 0; h < G; ++h) members[h] = 0;
    }

    // The mainloop issues the same GMMA sequence at every k-step (a GMMA under a
    // data-dependent branch makes ptxas insert warpgroup.arrive fences): R = 1 when the
    // item is a single run (the usual case; its accumulator is accum[0], its dy box the
    // head's), else R = G, one GMMA per possible head (non-heads compute on stale boxes
    // and are never stored).
    const bool single = __popc(heads) == 1;
    const int head0 = single ? __ffs(heads) - 1 : 0;
    if (single) {  // the one nonzero member set moves to accum[0]'s
      uint32_t all = 0;
      CUTE_UNROLL
      for (int h = 0; h < G; ++h) {
        all |= members[h];
        members[h] = 0;
      }
      members[0] = all;
    }
    auto mainloop = [&](auto runs) {
      constexpr int R = decltype(runs)::value;
      int in_flight = 0;
      for (int k = k_begin; k < k_end; ++k) {
        pipeline.consumer_wait(read_state);
        const int stage = read_state.index();
        CUTE_UNROLL
        for (int h = 0; h < R; ++h) warpgroup_fence_operand(accum[h]);
        warpgroup_arrive();
        const GMMA::ScaleOut scale = k == k_begin ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
        CUTE_UNROLL
        for (int h = 0; h < R; ++h) {
          mma.accumulate_ = scale;
          CUTE_UNROLL
          for (int kb = 0; kb < size<2>(tCrA); ++kb) {
            // k-block kb is k-block kb % KB of the head's box kb / KB of this stage.
            gemm(mma, tCrA(_, _, kb, stage), tCrB(_, _, kb % KB, (stage * Cfg::kBoxesK + kb / KB) * G + head0 + h),
                 accum[h]);
            mma.accumulate_ = GMMA::ScaleOut::One;
          }
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();
        CUTE_UNROLL
        for (int h = 0; h < R; ++h) warpgroup_fence_operand(accum[h]);
        if (in_flight) {
          pipeline.consumer_release(release_state);
          ++release_state;
        }
        in_flight = 1;
        ++read_state;
      }
      warpgroup_wait<0>();
      CUTE_UNROLL
      for (int h = 0; h < R; ++h) warpgroup_fence_operand(accum[h]);
      if (in_flight) {
        pipeline.consumer_release(release_state);
        ++release_state;
      }
    };
    if (single) {
      mainloop(Int<1>{});
    } else {
      mainloop(Int<G>{});
    }

    // Epilogue: the G blocks into the shared [G * BS, BS] tile (slot g's block from its
    // run's accumulator, zeros where no run holds it), then 16-byte copies of the item's
    // slots to dw or to this split's workspace.
    cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, kEpilogueBarrier);  // the last copy has read the tile
    CUTE_UNROLL
    for (int i = 0; i < size(accum[0]); ++i) {
      const int row = get<0>(tCc(i));
      const int col = get<1>(tCc(i));
      const int g = row / BS;
      float v = 0.f;
      CUTE_UNROLL
      for (int h = 0; h < G; ++h) v = ((members[h] >> g) & 1u) ? accum[h](i) : v;
      if (float_out) {
        tile_f[row * BS + col] = v;
      } else {
        tile_o[row * BS + col] = static_cast<OutT>(v);
      }
    }
    cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, kEpilogueBarrier);
    const int64_t first = static_cast<int64_t>(item.slot_begin) * BS * BS;  // element offset of the item's slots
    const int elems = (item.slot_end - item.slot_begin) * BS * BS;
    const uint4* src = reinterpret_cast<const uint4*>(shared.c.data());
    uint4* dst;
    int vecs;
    if (split) {
      dst = reinterpret_cast<uint4*>(args.workspace + static_cast<int64_t>(item.split) * p.cap * BS * BS + first);
      vecs = elems * static_cast<int>(sizeof(float)) / 16;
    } else if (float_out) {
      dst = reinterpret_cast<uint4*>(static_cast<float*>(p.dw) + first);
      vecs = elems * static_cast<int>(sizeof(float)) / 16;
    } else {
      dst = reinterpret_cast<uint4*>(static_cast<OutT*>(p.dw) + first);
      vecs = elems * static_cast<int>(sizeof(OutT)) / 16;
    }
    for (int v = ctid; v < vecs; v += kWarpgroupThreads) dst[v] = src[v];
  }
}

template <class Cfg>
cudaError_t LaunchSddSmallConfig(const SddParams& p, const Launch& launch) {
  using T = typename Cfg::T;
  using OutT = typename Cfg::OutT;
  auto kernel = &SddSmallSm90Kernel<Cfg>;
  auto reduce = &SddReduceKernel<OutT>;
  if (launch.prepare_only) return PrepareKernel(kernel, Cfg::kSmemBytes, reduce);
  const plan::SddPlan pl = SddPlanFor<Cfg::kBs>(p, launch.plan_sms > 0 ? launch.plan_sms : launch.num_sms);
  if (p.n > INT32_MAX || static_cast<int64_t>(p.cb) * Cfg::kBs > INT32_MAX ||
      static_cast<int64_t>(p.kb) * Cfg::kBs > INT32_MAX) {
    return cudaErrorInvalidValue;  // TMA coordinates are 32-bit
  }
  float* ws = static_cast<float*>(launch.workspace);
  if (pl.splits > 1 && ws == nullptr) return cudaErrorInvalidValue;
  const int n = static_cast<int>(p.n);
  SddSmallArgs<Cfg> args{
      p, pl,
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalOperand(static_cast<const T*>(p.x), p.cb * Cfg::kBs, n),
                          typename Cfg::SmemLayoutBoxes{}(cute::_, cute::_, 0)),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Cfg::GlobalOperand(static_cast<const T*>(p.dy), p.kb * Cfg::kBs, n),
                          typename Cfg::SmemLayoutBoxes{}(cute::_, cute::_, 0)),
      ws};
  const int grid = plan::PersistentGrid(plan::SddNumItems(pl), launch.num_sms > 0 ? launch.num_sms : 1, 1);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, launch.stream>>>(args);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || pl.splits == 1) return err;
  return LaunchSddReduce<OutT>(reduce, ws, p, pl.splits, Cfg::kBs, launch);
}

template <typename T, typename OutT>
cudaError_t DispatchSddSmall(const SddParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8: return LaunchSddSmallConfig<SddSmallConfig<T, OutT, 8>>(p, launch);
    case 16: return LaunchSddSmallConfig<SddSmallConfig<T, OutT, 16>>(p, launch);
    case 32: return LaunchSddSmallConfig<SddSmallConfig<T, OutT, 32>>(p, launch);
    default: return cudaErrorInvalidValue;
  }
}

// float32 inputs on TF32 GMMA (x^T and dy^T, K-major), float32 output: blocks 8, 16 and
// 32. A template so that only the TU that calls it (bsmm_sm90_sdd_small_tf32.cu)
// compiles the kernels.
template <typename T = cutlass::tfloat32_t>
cudaError_t DispatchSddSmallTF32(const SddParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8: return LaunchSddSmallConfig<SddSmallConfig<T, float, 8>>(p, launch);
    case 16: return LaunchSddSmallConfig<SddSmallConfig<T, float, 16>>(p, launch);
    case 32: return LaunchSddSmallConfig<SddSmallConfig<T, float, 32>>(p, launch);
    default: return cudaErrorInvalidValue;  // 64, 128: bsmm_sm90_sdd.cuh
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_SDD_SMALL_CUH_
