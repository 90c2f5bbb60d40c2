// sm_90a DSD kernel, the "stacked" variant, for blocks 8, 16, 32 and 64: every tensor-core
// operation computes a useful product. 16-bit inputs; output 16-bit or float32.
//
// The baseline for these blocks (bsmm_sm90_dsd_packed.cuh) packs 64 / BS outputs into one
// 64-wide tile with a block-diagonal weight stage, so only 1 / P of its MMA work is useful.
// Here a tile is one output block column (BS wide) of 128 rows, and its layout entries are
// stacked along K instead: a stage holds D = 64 / BS entries,
//
//   A stage [128, 64] = [a_0 | a_1 | ... | a_{D-1}]   a_d = the [128, BS] input slice of entry d
//   B stage [64, BS]  = [W_0 ; W_1 ; ... ; W_{D-1}]   W_d = the [BS, BS] block of entry d
//
// so A @ B = sum_d a_d W_d, the tile's partial sum over D entries, with wgmma N = BS (at
// block 64, D = 1: the baseline's tile, with the order, work list and epilogue below). Entries
// come from the layout's flat work list (col_work / row_work: one (input block, slot) pair
// per entry, in visiting order), so the producer reads one 8-byte pair per entry and no
// chain of dependent index loads. Entries past the output's end load both boxes from
// outside the tensors, which the TMA unit fills with zeros.
//
// Tiles are row-tile-major (plan::DsdStackedItemAt): the CTAs of a wave share the rows of
// `a` they read, which L2 then holds.
//
// Overlapped epilogue (ping-pong): the two consumer warpgroups take alternate tiles of the
// CTA, each tile whole (two m64 wgmma per k16 slice), over one pipeline whose stages are
// each consumed by one warpgroup (num_consumers = 128, as CUTLASS's ping-pong kernel).
// While one warpgroup converts and stores its tile, the other runs its mainloop. Each
// warpgroup has its own epilogue buffer, named barrier and TMA store.
//
// The two mainloops take turns (SharedStorage::order, as CUTLASS's ping-pong kernel orders
// its math warpgroups). A warpgroup that skips the other's tile jumps its pipeline state
// ahead by that tile's steps; an mbarrier wait only tells the parity of a stage's phase, so
// a warpgroup waiting more than a ring of stages ahead would take an older fill of the stage
// for the one it wants (a wrong result, then releases out of turn: hangs and faults, seen at
// 8192 cubed, where an output has more steps than there are stages). Waiting for the
// other warpgroup to have waited on all of its stages first keeps every wait within one
// phase of the fill it names.
//
// Shared-memory layouts: every [128, BS] A slice, [BS, BS] B block and the [128, BS]
// epilogue tile are whole swizzle-atom tilings (AtomFor, BS elements wide), as in the
// packed kernel, whose boxes and layouts these reuse.
//
// Unverified on hardware: behind the Hopper gate's "stacked" key (jax_blocksparse/verified.py).
#ifndef JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_STACKED_CUH_
#define JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_STACKED_CUH_

#include "sm90/bsmm_sm90_common.cuh"
#include "sm90/bsmm_sm90_dsd_packed.cuh"  // the boxes and global views it shares

namespace jbs {
namespace sm90 {
namespace detail {

template <typename T_, typename OutT_, int BS_, bool TRANS_W_>
struct DsdStackedConfig {
  using T = T_;
  using OutT = OutT_;
  static constexpr int kBs = BS_;
  static constexpr bool kTransW = TRANS_W_;
  static constexpr int kDepth = 64 / kBs;  // entries per stage (plan::DsdStackedSteps's depth)
  static constexpr int kTileM = 128;
  static constexpr int kStageK = 64;
  // Stages of (128 + BS) x 64 elements and two epilogue tiles within 227 KB: 8 up to block
  // 32, 6 at block 64 (24 KB a stage, 64 KB of float32 epilogue tiles).
  static constexpr int kStages = kBs <= 32 ? 8 : 6;
  static constexpr int kConsumers = 2;  // ping-pong: alternate tiles
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;
  // The producer holds a stage's D pairs in registers (40 spill at block 8); the consumers'
  // accumulators are small ([128, BS] per warpgroup). The same total as CUTLASS's 40 / 232.
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static_assert(kWarpgroupThreads * (kProducerRegs + kConsumers * kConsumerRegs) <= 64512,
                "the register file, as CUTLASS's warp-specialized kernels budget it");
  static_assert(sizeof(T) == 2, "the stacked kernel takes 16-bit inputs");
  static_assert(kDepth * kBs == kStageK && kBs % 8 == 0, "blocks 8, 16, 32, 64: wgmma N = BS");

  using TileM = cute::Int<kTileM>;
  using Bs = cute::Int<kBs>;
  using StageK = cute::Int<kStageK>;
  using Stages = cute::Int<kStages>;
  static constexpr cute::GMMA::Major kMajorB = kTransW ? cute::GMMA::Major::K : cute::GMMA::Major::MN;

  // A: as the packed kernel's: (128, 64, stage) for GMMA, (128, BS, stage * D + d) for TMA.
  using AtomA = AtomFor<T, cute::GMMA::Major::K, kBs>;
  using SmemLayoutA = decltype(cute::tile_to_shape(AtomA{}, cute::make_shape(TileM{}, StageK{}, Stages{})));
  using SmemLayoutASlices =
      decltype(cute::tile_to_shape(AtomA{}, cute::make_shape(TileM{}, Bs{}, cute::Int<kStages * kDepth>{})));
  using SliceA = decltype(cute::tile_to_shape(AtomA{}, cute::make_shape(TileM{}, Bs{})));  // one TMA box
  // B: [BS, BS] blocks (N, K) stacked along K: (BS, 64, stage) for GMMA, (BS, BS, stage * D + d) for TMA.
  using AtomB = AtomFor<T, kMajorB, kBs>;
  using BlockB = decltype(cute::tile_to_shape(AtomB{}, cute::make_shape(Bs{}, Bs{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(BlockB{}, cute::make_shape(Bs{}, StageK{}, Stages{})));
  using SmemLayoutBBlocks =
      decltype(cute::tile_to_shape(BlockB{}, cute::make_shape(Bs{}, Bs{}, cute::Int<kStages * kDepth>{})));
  // The global views and TMA boxes of the packed kernel: a as (M, K); w as (N, K) blocks;
  // out as (M, N). Epilogue: one [128, BS] tile (the packed kernel's store box) per
  // consumer warpgroup.
  using Packed = DsdPackedConfig<T, OutT, kBs, kTransW>;
  using AtomC = typename Packed::AtomC;
  using SmemLayoutC = typename Packed::SliceC;

  // One warpgroup per tile: its 128 rows are two m64 wgmma per k16 slice.
  using MmaOp = decltype(cute::GMMA::ss_op_selector<T, T, float, cute::Shape<cute::_64, Bs, StageK>,
                                                    cute::GMMA::Major::K, kMajorB>());
  using TiledMma = decltype(cute::make_tiled_mma(MmaOp{}, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>{}));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<T, cute::cosize_v<SmemLayoutA>, 1024> a;
    cute::array_aligned<T, cute::cosize_v<SmemLayoutB>, 1024> b;
    cute::array_aligned<OutT, cute::cosize_v<SmemLayoutC>, 1024> c[kConsumers];
    typename Pipeline::SharedStorage pipe;
    // order[c] completes a phase when the other consumer warpgroup has waited on every stage
    // of its tile: consumer c may then start its own (see the kernel).
    cutlass::arch::ClusterBarrier::ValueType order[kConsumers];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the sm_90 limit");
  static_assert(offsetof(SharedStorage, a) % 1024 == 0 && offsetof(SharedStorage, b) % 1024 == 0 &&
                    offsetof(SharedStorage, c) % 1024 == 0 && (cute::cosize_v<SmemLayoutC> * sizeof(OutT)) % 1024 == 0,
                "operand and epilogue buffers off 1024-byte alignment");
  static_assert(offsetof(SharedStorage, pipe) % 8 == 0 && alignof(typename Pipeline::SharedStorage) >= 8,
                "mbarriers must be 8-byte aligned");
  static constexpr uint32_t kStageBytes = kDepth * (kTileM * kBs + kBs * kBs) * sizeof(T);
  static_assert(kStageBytes == (kTileM + kBs) * kStageK * sizeof(T), "a stage is one A tile and one B stack");

  using TmaA = typename Packed::TmaA;
  using TmaB = typename Packed::TmaB;
  using TmaC = typename Packed::TmaC;
  // The packed kernel asserts its boxes (CheckTmaBox); these are the same boxes.
  static_assert(cute::is_same_v<SliceA, typename Packed::SliceA> && cute::is_same_v<BlockB, typename Packed::BlockB>,
                "the stacked kernel's boxes are the packed kernel's");
};

template <class Cfg>
struct DsdStackedArgs {
  DsdParams p;
  plan::DsdPlan plan;  // pack 1: group q = the q-th output visited
  typename Cfg::TmaA tma_a;
  typename Cfg::TmaB tma_b;
  typename Cfg::TmaC tma_c;
};

// The q-th output visited and its range of the work list.
__device__ __forceinline__ plan::StackedRange StackedRangeOf(const DsdParams& p, int q) {
  const int32_t ptr[2] = {__ldg(p.work_ptr + q), __ldg(p.work_ptr + q + 1)};
  return plan::DsdStackedRange(ptr, p.cap, 0);
}

// The (input block, slot) pair of work-list entry `e`, or false where it contributes
// nothing (a padding or out-of-range slot, an out-of-range input block).
__device__ __forceinline__ bool StackedEntrySource(const DsdParams& p, int nnz, int e, int* slot, int* in_block) {
  const int2 pair = __ldg(reinterpret_cast<const int2*>(p.work) + e);
  if (pair.y < 0 || pair.y >= nnz || pair.x < 0 || pair.x >= p.nin) return false;
  *in_block = pair.x;
  *slot = pair.y;
  return true;
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    DsdStackedSm90Kernel(const __grid_constant__ DsdStackedArgs<Cfg> args) {
  using namespace cute;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  constexpr int BS = Cfg::kBs;
  constexpr int D = Cfg::kDepth;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  const DsdParams& p = args.p;
  const plan::DsdPlan& pl = args.plan;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  const int warp_in_group = (threadIdx.x / 32) % 4;

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kStageBytes;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = kWarpgroupThreads;  // each stage is read by one warpgroup
  Pipeline pipeline(shared.pipe, pipe_params, Shape<_1, _1, _1>{});
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(args.tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_b.get_tma_descriptor());
    prefetch_tma_descriptor(args.tma_c.get_tma_descriptor());
    for (int c = 0; c < Cfg::kConsumers; ++c) {
      cutlass::arch::ClusterBarrier::init(&shared.order[c], kWarpgroupThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int n = static_cast<int>(p.n);
  const int64_t lda = static_cast<int64_t>(p.nin) * BS;
  const int64_t ldc = static_cast<int64_t>(p.nseg) * BS;
  const int nnz = Clamp(__ldg(p.nnz), 0, p.cap);
  const int64_t items = plan::DsdNumItems(pl);

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (warp_in_group != 0 || !cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutASlices{});
    Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutBBlocks{});
    Tensor gA = local_tile(args.tma_a.get_tma_tensor(make_shape(n, static_cast<int>(lda))),
                           Shape<typename Cfg::TileM, typename Cfg::Bs>{}, make_coord(_, _));
    Tensor mB = [&] {
      if constexpr (Cfg::kTransW) {
        return args.tma_b.get_tma_tensor(make_shape(p.cap * BS, BS));
      } else {
        return args.tma_b.get_tma_tensor(make_shape(BS, p.cap * BS));
      }
    }();
    Tensor gB = local_tile(mB, Shape<typename Cfg::Bs, typename Cfg::Bs>{}, make_coord(_, _));
    auto [tAgA, tAsA] = tma_partition(args.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    auto [tBgB, tBsB] = tma_partition(args.tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));

    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    for (int64_t t = blockIdx.x; t < items; t += gridDim.x) {
      const plan::DsdItem item = plan::DsdStackedItemAt(pl, t);
      const plan::StackedRange range = StackedRangeOf(p, item.group);
      const int steps = plan::DsdStackedSteps(range, D);
      for (int step = 0; step < steps; ++step) {
        // The stage's pairs first (independent loads), then its copies. An entry that
        // contributes nothing reads one tile past the end of a (zeros) and slot cap of w.
        int2 src[D];  // (input block, slot)
        uint32_t present = 0;
        CUTE_UNROLL
        for (int d = 0; d < D; ++d) {
          const int e = plan::DsdStackedEntry(range, D, step, d);
          src[d] = make_int2(0, p.cap);
          if (e >= 0 && StackedEntrySource(p, nnz, e, &src[d].y, &src[d].x)) present |= 1u << d;
        }
        pipeline.producer_acquire(state);
        auto* barrier = pipeline.producer_get_barrier(state);
        const int stage = state.index();
        CUTE_UNROLL
        for (int d = 0; d < D; ++d) {
          const int m_tile = (present >> d) & 1u ? item.m_tile : pl.m_tiles;
          copy(args.tma_a.with(*barrier), tAgA(_, m_tile, src[d].x), tAsA(_, stage * D + d));
          if constexpr (Cfg::kTransW) {
            copy(args.tma_b.with(*barrier), tBgB(_, src[d].y, 0), tBsB(_, stage * D + d));
          } else {
            copy(args.tma_b.with(*barrier), tBgB(_, 0, src[d].y), tBsB(_, stage * D + d));
          }
        }
        ++state;
      }
    }
    pipeline.producer_tail(state);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int consumer = warpgroup - 1;  // takes the CTA's tiles j with j % 2 == consumer
  const int wtid = threadIdx.x % kWarpgroupThreads;
  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Cfg::SmemLayoutB{});
  Tensor sC = make_tensor(make_smem_ptr(shared.c[consumer].data()), typename Cfg::SmemLayoutC{});
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(wtid);
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  Tensor accum = partition_fragment_C(mma, Shape<typename Cfg::TileM, typename Cfg::Bs>{});
  Tensor tCsC = thr_mma.partition_C(sC);
  Tensor gC_all = local_tile(args.tma_c.get_tma_tensor(make_shape(n, static_cast<int>(ldc))),
                             Shape<typename Cfg::TileM, typename Cfg::Bs>{}, make_coord(_, _));
  auto tma_c_thr = args.tma_c.get_slice(0);
  const bool store_thread = wtid == 0;
  const int barrier_id = kEpilogueBarrier + consumer;

  PipelineState read_state;
  PipelineState release_state;
  int64_t j = 0;       // the CTA's tile count
  uint32_t turns = 0;  // this warpgroup's tiles so far
  const int other = 1 - consumer;
  for (int64_t t = blockIdx.x; t < items; t += gridDim.x, ++j) {
    const plan::DsdItem item = plan::DsdStackedItemAt(pl, t);
    const int steps = plan::DsdStackedSteps(StackedRangeOf(p, item.group), D);
    if (j % Cfg::kConsumers != consumer) {  // the other warpgroup's tile: skip its stages
      read_state.advance(steps);
      release_state.advance(steps);
      continue;
    }
    // Its turn: the other warpgroup has waited on every stage of the tile before this one
    // (tile 0, consumer 0's first, has none before it). The k-th completion of order[c]
    // is awaited with parity k & 1, and the turns alternate, so no wait is a phase behind.
    if (j > 0) cutlass::arch::ClusterBarrier::wait(&shared.order[consumer], (turns - (consumer == 0 ? 1 : 0)) & 1);
    ++turns;
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    int in_flight = 0;
    for (int step = 0; step < steps; ++step) {
      pipeline.consumer_wait(read_state);
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        gemm(mma, tCrA(_, _, kb, read_state.index()), tCrB(_, _, kb, read_state.index()), accum);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      if (in_flight) {
        pipeline.consumer_release(release_state);
        ++release_state;
      }
      in_flight = 1;
      ++read_state;
    }
    cutlass::arch::ClusterBarrier::arrive(&shared.order[other]);  // the other's turn
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    if (in_flight) {
      pipeline.consumer_release(release_state);
      ++release_state;
    } else {
      clear(accum);
    }

    // Epilogue of this warpgroup only: its buffer, its barrier, its store.
    const int out = __ldg(p.order + item.group);
    if (store_thread) tma_store_wait<0>();  // this buffer's previous store has read it
    cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, barrier_id);
    StoreAccum(accum, tCsC);
    tma_store_fence();
    cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, barrier_id);
    if (store_thread && out >= 0 && out < p.nseg) {
      copy(args.tma_c, tma_c_thr.partition_S(sC), tma_c_thr.partition_D(gC_all(_, _, item.m_tile, out)));
      tma_store_arrive();
    }
  }
  if (store_thread) tma_store_wait<0>();
}

template <class Cfg>
cudaError_t LaunchDsdStackedConfig(const DsdParams& p, const Launch& launch) {
  auto kernel = &DsdStackedSm90Kernel<Cfg>;
  if (launch.prepare_only) return PrepareKernel(kernel, Cfg::kSmemBytes);
  using T = typename Cfg::T;
  using OutT = typename Cfg::OutT;
  using Packed = typename Cfg::Packed;
  if (p.work == nullptr || p.work_ptr == nullptr) return cudaErrorInvalidValue;  // the v2 targets pass them
  if (p.n > INT32_MAX - Cfg::kTileM || static_cast<int64_t>(p.nin) * Cfg::kBs > INT32_MAX ||
      static_cast<int64_t>(p.nseg) * Cfg::kBs > INT32_MAX || (static_cast<int64_t>(p.cap) + 1) * Cfg::kBs > INT32_MAX) {
    return cudaErrorInvalidValue;  // TMA coordinates are 32-bit
  }
  const int n = static_cast<int>(p.n);
  DsdStackedArgs<Cfg> args{
      p, plan::MakeDsdPlan(p.n, Cfg::kTileM, p.nseg, 1),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{},
                          Packed::GlobalA(static_cast<const T*>(p.a), n, int64_t{p.nin} * Cfg::kBs),
                          typename Cfg::SliceA{}),
      cute::make_tma_copy(cute::SM90_TMA_LOAD{}, Packed::GlobalB(static_cast<const T*>(p.w), p.cap),
                          typename Cfg::BlockB{}),
      cute::make_tma_copy(cute::SM90_TMA_STORE{},
                          Packed::GlobalC(static_cast<OutT*>(p.out), n, int64_t{p.nseg} * Cfg::kBs),
                          typename Cfg::SmemLayoutC{})};
  const int grid = plan::PersistentGrid(plan::DsdNumItems(args.plan), launch.num_sms > 0 ? launch.num_sms : 1, 1);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, launch.stream>>>(args);
  return cudaGetLastError();
}

template <typename T, typename OutT>
cudaError_t DispatchDsdStacked(bool transpose_w, const DsdParams& p, const Launch& launch) {
  switch (p.bs) {
    case 8:
      return transpose_w ? LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 8, true>>(p, launch)
                         : LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 8, false>>(p, launch);
    case 16:
      return transpose_w ? LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 16, true>>(p, launch)
                         : LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 16, false>>(p, launch);
    case 32:
      return transpose_w ? LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 32, true>>(p, launch)
                         : LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 32, false>>(p, launch);
    case 64:
      return transpose_w ? LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 64, true>>(p, launch)
                         : LaunchDsdStackedConfig<DsdStackedConfig<T, OutT, 64, false>>(p, launch);
    default: return cudaErrorInvalidValue;  // 128: the baseline only (bsmm_sm90_dsd.cuh)
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jbs

#endif  // JAX_BLOCKSPARSE_CUDA_SM90_BSMM_SM90_DSD_STACKED_CUH_
