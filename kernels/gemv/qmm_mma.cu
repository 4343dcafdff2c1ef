// The quantized GEMM for a few rows of X on Hopper's (Ampere's) warp MMA: a native CUDA variant
// beside qmm.metal (DESIGN.md: research variants may exist beside the portable body). Y[M, N] =
// X[M, K] @ W^T for M up to 64, W Q4_0 or Q8_0 in the v3 layout (kernels.gemv.repack: every
// block's quants, row after row, then every fp16 scale) read where it lies: no second copy.
//
// The products are mma.sync m16n8k16 with W as the A operand (16 of its rows a tile) and X^T as B
// (8 of X's rows a tile). The K order inside a product is free as long as A and B agree, and it
// is chosen so that each lane's operands are whole pieces of its own block:
//   lane (q = lane / 4, c = lane % 4) takes W rows q and q + 8 of its tile and, of each run of 4
//   blocks (128 values of K, a "group") g, block 4 g + c: a Q4_0 block's 16 bytes of nibbles
//   (Q8_0's 32 bytes) a row. Its fragment slots (2c, 2c + 1) and (2c + 8, 2c + 9) of product s
//   hold 4 consecutive values of that block: Q4_0's values 4w .. 4w + 3 (low nibbles of word w,
//   s = 2w) or 16 + 4w .. (high nibbles, s = 2w + 1); Q8_0's 4s .. 4s + 3. B's lane takes the
//   same 4 values of X's row 8 j + q.
// A CTA of NW warps takes 16 TM NW / KW rows of W and one part of K (KS parts, grid.y; the parts'
// float32 sums are added by qmm_reduce.metal's launch). Its warps are NW / KW row warps by KW K
// warps: a stage holds SG KW groups, K warp j takes the stage's groups j SG .. j SG + SG - 1 of its
// row warp's rows, and the K warps' sums are added through shared memory at the end. (At 16 rows
// the 8B's gate+up has 224 CTAs of 4 warps, 7 warps an SM, which wait on their own chains half the
// time: K warps give an SM more warps with no second launch.) It walks its part in stages of SG KW
// groups through a ring of STAGES slots of shared memory, filled with cp.async STAGES - 1 stages ahead:
//   X's rows for the stage, copied once for all NW warps: each warp's products read every row of
//     X, so X read from L2 by every warp on its own cost more traffic than W (at 2bb81c2 and
//     a71ee3e 64 rows of X took 6.5-7x 16 rows). Blocks 72 bytes apart and rows 32 bytes off a
//     128-byte line, so that a warp's 8-byte reads of its fragments fall on distinct banks;
//   each warp's rows of W for the stage: a row's SG groups are one run of the v3 layout, copied
//     16 bytes a lane, consecutive lanes on consecutive bytes (the fragments' own order reads 64
//     bytes of 8 rows 2 KiB apart: 45% of the copy peak, where runs reach 85%; kernels/gemv/
//     NOTES.md, "W's load order, measured"). Odd rows' pieces are stored swizzled (W_SWZ), so
//     that rows q and q + 1 fall on other banks with no pad.
// Nibbles become halves by the 0x6400 trick (1024 + q exactly), less 1032 (1152 for Q8_0's
// bytes), times the block's scale.
//
// W's bytes are the v3 layout (ROWS8 0) or RowBlocks (ROWS8 1, kernels.gemv.interleave_rows: a row
// block's 8 rows interleaved a group at a time), where a stage's pieces of a row block's 8 rows are
// one run of 512 SG bytes (Q4_0) and the ring's slots are filled as from the v3 layout.
//
// Constants (NVRTC -D): QT 0 Q4_0 / 1 Q8_0, ROWS8, M (rows of X, 1..64), N, K (a multiple of 128), TM
// (16-row tiles a warp), NW (warps a CTA), KW (K warps: 1, 2 or 4, dividing NW), KS (parts of K),
// SG (groups of K a warp a stage), STAGES, PF
// (0, or stages of each W row asked of the L2 in one run, PF stages ahead of the ring's copies),
// GATED (W is [gate; up], N = 2F: a warp's tiles alternate gate and up rows F apart, Y = silu(gate)
// * up, [M, F]), RESID (Y + R), SK (0, or stream-K: SK CTAs, each a contiguous run of the launch's
// (CTA tile, stage) units, so that every CTA streams the same share of W whatever the tiles' count;
// below), ENTRY. Inputs: x [M, K] fp16, w (the Packed bytes), residual
// [M, N] (RESID). Output: y fp16 [M, N_out] (KS 1), or the parts float32 [KS, M, N] (KS > 1: the
// epilogue is the adding launch's). Launch: (ceil(rows / (16 TM / (1 + GATED) NW / KW)), KS) CTAs of
// 32 NW threads, SMEM_BYTES of dynamic shared memory (kernels.gemv.qmm_mma_smem).
// Stream-K (SK > 0, KS 1): SK CTAs; CTA p takes units [p U / SK, (p + 1) U / SK) of the U = TILES x
// STAGES_K, tile by tile. A tile it runs whole it writes as KS 1 does; a part of a tile (its first or
// last) it leaves as float32 sums in its slot of `spill` (2 a CTA: first, last), then counts on the
// tile's counter; the CTA that counts last adds the tile's parts in the order of their CTAs (its own
// from registers) and writes Y, and sets the counter back to 0. No CTA waits on another. Extra
// parameters: counters (uint32, TILES, zero), and the output spill (float32, 2 SK slots of
// SPILL_FLOATS).
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

constexpr int MT = (M + 7) / 8;             // X's 8-row tiles
constexpr int XC = MT < 4 ? MT : 4;          // X's tiles whose loads go out together
constexpr int QB = QT == 0 ? 16 : 32;       // quant bytes a block
constexpr int QV = QB / 16;                 // 16-byte loads a block row
constexpr int GROUPS = K / 128;
constexpr int HT = GATED ? TM / 2 : TM;      // output tiles a warp (gated: a gate and an up tile each)
constexpr int OUT_N = GATED ? N / 2 : N;     // Y's columns
static_assert(K % 128 == 0, "qmm_mma: K whole groups of 128");
static_assert(!GATED || (TM % 2 == 0 && N % 2 == 0), "qmm_mma: a gated warp takes gate and up tiles in pairs");
static_assert(M >= 1 && M <= 64, "qmm_mma: 1..64 rows of X");
static_assert(NW % KW == 0 && (PF == 0 || KW == 1), "qmm_mma: K warps divide the warps; W's L2 runs with one");
static_assert(!ROWS8 || (PF == 0 && N % (GATED ? 16 : 8) == 0), "qmm_mma: RowBlocks are whole row blocks, no L2 runs");
constexpr int RW = NW / KW;                 // row warps a CTA
constexpr int SGK = SG * KW;                // groups a stage (every K warp's)

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A warp's local row lr of W (tile lr / 16's row lr % 16; rows q and q + 8 of its fragments are
// rows lr % 16 < 8 and >= 8): its offset from the warp's first row (gated: tiles alternate gate's
// and up's rows, F = N / 2 apart), and that offset within gate's or up's rows.
__host__ __device__ constexpr u32 w_local(int lr) { return (GATED ? (lr / 32) * 16 : (lr / 16) * 16) + lr % 16; }
__host__ __device__ constexpr u32 w_row_offset(int lr) { return (GATED ? (lr / 16) % 2 * (N / 2) : 0) + w_local(lr); }

__device__ __forceinline__ u32 shared_address(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void copy16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void copy8(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// a 128-byte line into the L2 (a thread's own address: cp.async.bulk.prefetch takes a uniform one,
// which NVRTC turns into a loop over the lanes)
__device__ __forceinline__ void prefetch_l2(const void* src) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src));
}
template <int N_>
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N_) : "memory"); }

constexpr int ROWS = 16 * TM;                // W rows a warp
constexpr int ROW_BYTES = SG * 4 * QB;       // a row's quants a stage (a warp's: its K warp's groups)
// a row's 16-byte pieces are stored XOR W_SWZ on odd rows, so that a quarter warp's reads (rows q and
// q + 1, lanes c) fall on distinct banks with no pad (Q4_0's rows of one group are 64 bytes apart:
// other halves of a line already)
constexpr int ROW_PITCH = ROW_BYTES;
// where W's bytes lie: a row's first quant and scale, and the step from a row's group of K to its next
// (v3: a row's quants, then its scales, are each one run; RowBlocks: a row block's 8 rows take
// turns a group at a time). Both are sums over a row's place in its row block and the block, so that
// a lane's base and a pass's constant offset add up (a lane's row in a block plus a pass's stays < 8).
__host__ __device__ constexpr size_t quant_row(u32 r) {
  return ROWS8 ? (size_t)(r / 8) * (K / 128 * 32 * QB) + (r % 8) * 4 * QB : (size_t)r * (K / 32 * QB);
}
__host__ __device__ constexpr u32 scale_row(u32 r) {  // (a thread's scale offsets are 32-bit, as before)
  return ROWS8 ? (r / 8) * (K / 128 * 64) + (r % 8) * 8 : r * (K / 32 * 2);
}
constexpr u32 QUANT_GROUP_STEP = ROWS8 ? 32 * QB : 4 * QB;
constexpr u32 SCALE_GROUP_STEP = ROWS8 ? 64 : 8;
// a row's p-th 16-byte piece of quants from its first group's
__host__ __device__ constexpr u32 quant_piece(u32 p) {
  return ROWS8 ? p / (4 * QV) * QUANT_GROUP_STEP + p % (4 * QV) * 16 : p * 16;
}
constexpr u32 W_SWZ = QT == 1 ? 1 : ROW_BYTES >= 128 ? 4 : 0;
constexpr int SCALE_PITCH = SG * 4 * 2;      // a row's scales a stage
constexpr int W_SLOT = ROWS * (ROW_PITCH + SCALE_PITCH);
constexpr int X_BLOCK = 72;                  // a block of X's 32 halves, 8 bytes of pad
constexpr int X_PITCH = (SGK * 4 * X_BLOCK + 96) / 128 * 128 + 32;  // a row of X: 32 past a line
constexpr int X_SLOT = (M * X_PITCH + 15) / 16 * 16;
constexpr int RING_BYTES = STAGES * (X_SLOT + NW * W_SLOT);
constexpr int SUM_BYTES = (KW - 1) * RW * 32 * TM * MT * 4 * 4;  // K warps' sums, after the ring's last use
constexpr int SMEM_BYTES = RING_BYTES > SUM_BYTES ? RING_BYTES : SUM_BYTES;
// the copies of a stage: X in 8-byte pieces (X_PPR a row), W's quants in 16-byte pieces (W_PPR a
// row), its scales in SP-byte pieces (S_PPR a row); where a row has fewer pieces than the threads
// (lanes), a pass takes several rows, else a row takes several passes
constexpr int X_PPR = SGK * 32;
constexpr bool X_ROWS_A_PASS = 32 * NW >= X_PPR;
constexpr int X_RP = X_ROWS_A_PASS ? 32 * NW / X_PPR : 1;
constexpr int X_SPLIT = X_ROWS_A_PASS ? 1 : X_PPR / (32 * NW);
constexpr int X_PASSES = X_ROWS_A_PASS ? (M + X_RP - 1) / X_RP : M * X_SPLIT;
constexpr int W_PPR = ROW_BYTES / 16;
constexpr bool W_ROWS_A_PASS = W_PPR <= 32;
constexpr int W_RP = W_ROWS_A_PASS ? 32 / W_PPR : 1;
constexpr int W_SPLIT = W_ROWS_A_PASS ? 1 : W_PPR / 32;
constexpr int W_PASSES = ROWS * W_PPR / 32;
// a warp's scales a stage in 16-byte pieces where they are one aligned run (v3), else 8 (a group's)
constexpr int SP = !ROWS8 && K % 256 == 0 && SG % 2 == 0 ? 16 : 8;
constexpr int S_PPR = SCALE_PITCH / SP;
constexpr int S_RP = 32 / S_PPR;
constexpr int S_PASSES = (ROWS + S_RP - 1) / S_RP;
constexpr bool PARTIAL = GROUPS % SGK != 0;  // the last stage holds fewer groups
static_assert(W_RP <= 8 && 8 % W_RP == 0, "qmm_mma: a pass of W's rows stays within 8 rows");
constexpr int STAGES_K = (GROUPS + SGK - 1) / SGK;
constexpr int PART_STAGES = (STAGES_K + KS - 1) / KS;  // stages of K a part
constexpr int CTA_COLS = 16 * HT * RW;                 // Y's columns (W's rows; gated: gate's) a CTA tile
constexpr int TILES = (OUT_N + CTA_COLS - 1) / CTA_COLS;
constexpr int SPILL_FLOATS = RW * TM * MT * 4 * 32;    // a CTA's sums of a tile
static_assert(SK == 0 || KS == 1, "qmm_mma: stream-K takes K whole (its parts are its own)");

extern "C" __global__ void __launch_bounds__(32 * NW)
ENTRY(const u16* __restrict__ x, const unsigned char* __restrict__ w, const u16* __restrict__ residual,
#if SK > 0
      unsigned int* __restrict__ counters,
#endif
      void* __restrict__ out
#if SK > 0
      , float* __restrict__ spill
#endif
) {
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 lane = threadIdx.x % 32, wn = threadIdx.x / 32;
  const u32 wr = KW == 1 ? wn : wn % RW, wk = KW == 1 ? 0u : wn / RW;  // (one K warp: the form before K warps)
  const u32 q = lane / 4, c = lane % 4;
  // CTA tile `tile`'s stages [st_first, st_first + stages); `part`: -1 the whole of K (Y written
  // here), else stream-K's slot of this CTA (0 its first unit's tile, 1 its last's). Without stream-K
  // the body is the kernel's own, in its order (its SASS as before SK was a constant)
#if SK > 0
  __shared__ u32 counted_last;
  auto segment = [&](const u32 tile, const u32 st_first, const u32 stages, const int part) {
#else
  {
  const u32 tile = blockIdx.x;
#endif
  // this warp's first output row (gated: of gate's rows and of up's)
  const u32 tile_base = (tile * RW + wr) * (16 * HT);
  const unsigned char* quants = w;
  const unsigned char* scales = w + (size_t)N * (K / 32) * QB;
  const u32 x_ring = shared_address(smem);
  const u32 w_ring = x_ring + STAGES * X_SLOT + wn * STAGES * W_SLOT;
#if SK == 0
  const u32 st_first = blockIdx.y * PART_STAGES;
  const u32 stages = st_first < (u32)STAGES_K ? min((u32)PART_STAGES, (u32)STAGES_K - st_first) : 0u;
#endif

  // stage st into slot `slot`: X's M rows (every thread), this warp's rows of W and their scales (its
  // lanes). Each thread's pieces sit at fixed offsets from a base worked out once here, so that a
  // stage's copies are an address and a cp.async each (at 1966436, with the offsets worked out
  // again every stage, the copies were half a stage's instructions).
  const u32 tid = threadIdx.x;
  const u32 x_m0 = X_ROWS_A_PASS ? tid / X_PPR : 0u, x_pc = X_ROWS_A_PASS ? tid % X_PPR : tid;
  const u16* x_src = x + (size_t)x_m0 * K + x_pc * 4;
  const u32 x_dst = x_m0 * X_PITCH + (x_pc / 8) * X_BLOCK + (x_pc % 8) * 8;
  const u32 w_r0 = W_ROWS_A_PASS ? lane / W_PPR : 0u, w_pc = W_ROWS_A_PASS ? lane % W_PPR : lane;
  const int w_left = (int)OUT_N - (int)(tile_base + w_r0);  // local rows of W this lane may copy
  const unsigned char* w_src = quants + quant_row(tile_base + w_r0) + wk * SG * QUANT_GROUP_STEP + quant_piece(w_pc);
  // where a pass's rows are an even number, a lane's rows keep w_r0's parity; else it is the pass's
  const u32 w_dst = w_r0 * ROW_PITCH + (w_pc ^ (W_RP % 2 == 0 ? (w_r0 & 1) * W_SWZ : 0u)) * 16;
  const u32 w_dst_odd = w_r0 * ROW_PITCH + (w_pc ^ W_SWZ) * 16;
  u32 s_src[S_PASSES], s_ok = 0;  // a scale piece's offset in the scales, and which may be copied
  const u32 s_r0 = lane / S_PPR, s_pc = lane % S_PPR;
#pragma unroll
  for (int i = 0; i < S_PASSES; ++i) {
    const u32 lr = s_r0 + i * S_RP;
    s_src[i] = scale_row(tile_base + w_row_offset(lr)) + (ROWS8 ? (wk * SG + s_pc) * 64 : wk * (SG * 8) + s_pc * SP);
    if (lr < (u32)ROWS && (int)w_local(lr) < (int)OUT_N - (int)tile_base) s_ok |= 1u << i;
  }
  // a stage's groups of K (X's), and this warp's of them
  auto stage_groups = [&](u32 st) { return min((u32)SGK, (u32)GROUPS - st * SGK); };
  auto warp_groups = [&](u32 st) { return min((u32)SG, (u32)max((int)stage_groups(st) - (int)(wk * SG), 0)); };
  auto copy_stage = [&](u32 st, u32 slot) {
    const u32 groups = stage_groups(st), wgroups = warp_groups(st);
    const u16* xg = x_src + (size_t)st * (SGK * 128);
    const u32 xs = x_ring + slot * X_SLOT + x_dst;
#pragma unroll
    for (int j = 0; j < X_PASSES; ++j) {
      const int jr = X_ROWS_A_PASS ? j * X_RP : j / X_SPLIT, jp = X_ROWS_A_PASS ? 0 : (j % X_SPLIT) * 32 * NW;
      const bool row_ok = !X_ROWS_A_PASS || M % X_RP == 0 || x_m0 + jr < (u32)M;
      if (row_ok && (!PARTIAL || x_pc + jp < groups * 32))
        copy8(xs + jr * X_PITCH + (jp / 8) * X_BLOCK, xg + (size_t)jr * K + jp * 4);
    }
    const unsigned char* wg = w_src + (size_t)st * (SGK * QUANT_GROUP_STEP);
    const u32 ws = w_ring + slot * W_SLOT;
#pragma unroll
    for (int i = 0; i < W_PASSES; ++i) {
      const int lr = W_ROWS_A_PASS ? i * W_RP : i / W_SPLIT, pc = W_ROWS_A_PASS ? 0 : (i % W_SPLIT) * 32;
      if ((int)w_local(lr) < w_left && (!PARTIAL || w_pc + pc < wgroups * (W_PPR / SG)))
        copy16(ws + (W_RP == 1 && lr % 2 ? w_dst_odd : w_dst) + lr * ROW_PITCH + pc * 16,
               wg + quant_row(w_row_offset(lr)) + quant_piece(pc));
    }
    const u32 ss = ws + ROWS * ROW_PITCH + s_r0 * SCALE_PITCH + s_pc * SP;
#pragma unroll
    for (int i = 0; i < S_PASSES; ++i)
      if ((s_ok >> i) & 1u && (!PARTIAL || s_pc * SP < wgroups * 8)) {
        if (SP == 16) copy16(ss + i * S_RP * SCALE_PITCH, scales + s_src[i] + st * (SGK * SCALE_GROUP_STEP));
        else copy8(ss + i * S_RP * SCALE_PITCH, scales + s_src[i] + st * (SGK * SCALE_GROUP_STEP));
      }
  };

  float acc[TM][MT][4];
#pragma unroll
  for (int t = 0; t < TM; ++t)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][j][e] = 0.0f;

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if ((u32)i < stages) copy_stage(st_first + i, i);
    copies_commit();
  }
  // W's rows asked of the L2 in runs of PF stages (a row's stages are contiguous in the v3 layout),
  // so that DRAM sees runs of PF * ROW_BYTES where the ring's copies alone ask ROW_BYTES of each
  // row a stage: PF_LINES lines a row, spread over the lanes
  constexpr int PF_LINES = PF * ROW_BYTES < 128 ? 1 : PF * ROW_BYTES / 128;
  auto prefetch_rows = [&](u32 from) {
    if (from >= stages) return;
    const u32 run = (st_first + from) * ROW_BYTES, row_end = GROUPS * 4 * QB;
#pragma unroll
    for (int k = 0; k < (ROWS * PF_LINES + 31) / 32; ++k) {
      const u32 p = lane + 32 * k, lr = p / PF_LINES, at = run + (p % PF_LINES) * 128;
      if (lr < (u32)ROWS && (int)w_local(lr) < (int)OUT_N - (int)tile_base && at < row_end)
        prefetch_l2(quants + (size_t)(tile_base + w_row_offset(lr)) * (K / 32 * QB) + at);
    }
  };
  if (PF > 0) {
    prefetch_rows(STAGES - 1);
    prefetch_rows(STAGES - 1 + PF);
  }
  for (u32 i = 0; i < stages; ++i) {
    copies_wait<STAGES - 2>();
    // one barrier a stage: every thread's copies of stage i are in, and every warp is done with
    // stage i - 1's slot, which the next copies fill
    __syncthreads();
    if (i + STAGES - 1 < stages) copy_stage(st_first + i + STAGES - 1, (i + STAGES - 1) % STAGES);
    copies_commit();
    if (PF > 0 && i % PF == 0 && i > 0) prefetch_rows(i + STAGES - 1 + PF);
    const u32 st = st_first + i, slot = i % STAGES;
    // read back as plain loads of shared memory (not asm), so that the compiler may schedule them
    // among the products, and not above the barrier
    const unsigned char* xs = smem + slot * X_SLOT;
    const unsigned char* ws = smem + STAGES * X_SLOT + wn * STAGES * W_SLOT + slot * W_SLOT;
    const u32 groups = warp_groups(st);
#pragma unroll
    for (u32 gi = 0; gi < (u32)SG; ++gi) {
      if (PARTIAL && gi >= groups) break;
      uint4 wq[TM][2][QV];
      u32 dd[TM][2];  // half2 (d, d)
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 lr = t * 16 + h * 8 + q;
#pragma unroll
          for (int v = 0; v < QV; ++v)
            wq[t][h][v] = *reinterpret_cast<const uint4*>(
                ws + lr * ROW_PITCH + (((gi * 4 + c) * QV + v) ^ (q % 2 * W_SWZ)) * 16);
          dd[t][h] = (u32)*reinterpret_cast<const u16*>(ws + ROWS * ROW_PITCH + lr * SCALE_PITCH + (gi * 4 + c) * 2) *
                     0x10001u;
        }
      // X's tiles in chunks of XC: a chunk's reads for all 8 products, then the products
#pragma unroll
      for (int j0 = 0; j0 < MT; j0 += XC) {
        uint2 b[8][XC];  // X's 4 values of product s: B's b0 b1 (slots 2c, 2c + 1), b2 b3 (2c + 8, 2c + 9)
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const u32 kx = QT == 0 ? 4 * (s / 2) + 16 * (s % 2) : 4 * s;
#pragma unroll
          for (int jj = 0; jj < XC; ++jj) {
            const int row = 8 * (j0 + jj) + (int)q;
            b[s][jj] = row < M ? *reinterpret_cast<const uint2*>(xs + row * X_PITCH + ((wk * SG + gi) * 4 + c) * X_BLOCK + 2 * kx)
                               : make_uint2(0u, 0u);
          }
        }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
#pragma unroll
        for (int t = 0; t < TM; ++t) {
          u32 a[4];  // a0a1 row q, a2a3 row q + 8 (slots 2c, 2c + 1); a4a5, a6a7 (2c + 8, 2c + 9)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            u32 lo, hi;
            if (QT == 0) {
              const uint4 v = wq[t][h][0];
              const u32 word = (s / 2) == 0 ? v.x : (s / 2) == 1 ? v.y : (s / 2) == 2 ? v.z : v.w;
              // bytes 0, 1 (2, 3) to the low bytes of two halves whose high bytes are 0x64, so that
              // one mask (one immediate: no register move before each LOP3) leaves 0x6400 | nibble
              const u32 p01 = prmt(word, 0x64646464u, 0x4140u), p23 = prmt(word, 0x64646464u, 0x4342u);
              if (s % 2 == 0) {  // low nibbles: 1024 + q, less 1032
                lo = hsub2(p01 & 0x640F640Fu, 0x64086408u);
                hi = hsub2(p23 & 0x640F640Fu, 0x64086408u);
              } else {  // high nibbles: 1024 + 16 q, / 16 less 72
                lo = hfma2(p01 & 0x64F064F0u, 0x2C002C00u, 0xD480D480u);
                hi = hfma2(p23 & 0x64F064F0u, 0x2C002C00u, 0xD480D480u);
              }
            } else {
              const uint4 v = wq[t][h][s / 4];
              const u32 word = (s % 4) == 0 ? v.x : (s % 4) == 1 ? v.y : (s % 4) == 2 ? v.z : v.w;
              const u32 u = word ^ 0x80808080u;  // int8 + 128
              lo = hsub2(prmt(u, 0x64646464u, 0x4140u), 0x64806480u);  // 1024 + u, less 1152
              hi = hsub2(prmt(u, 0x64646464u, 0x4342u), 0x64806480u);
            }
            a[h] = hmul2(lo, dd[t][h]);
            a[2 + h] = hmul2(hi, dd[t][h]);
          }
#pragma unroll
          for (int jj = 0; jj < XC; ++jj)
            if (j0 + jj < MT) mma(acc[t][j0 + jj], a, b[s][jj].x, b[s][jj].y);
        }
      }
    }
    }
  }

  if (KW > 1) {  // K warp 0 adds the others' sums, in their order; the ring is free once every copy is in
    copies_wait<0>();
    __syncthreads();
    float* sums = reinterpret_cast<float*>(smem);
    constexpr int A = TM * MT * 4;  // a lane's sums
    if (wk > 0) {
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sums[(((wk - 1) * RW + wr) * A + (t * MT + j) * 4 + e) * 32 + lane] = acc[t][j][e];
    }
    __syncthreads();
    if (SK == 0 && wk > 0) return;
    if (SK == 0 || wk == 0)
#pragma unroll
    for (int o = 0; o < KW - 1; ++o)
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[t][j][e] += sums[((o * RW + wr) * A + (t * MT + j) * 4 + e) * 32 + lane];
  }

#if SK > 0
  if (part >= 0) {  // a part of the tile's K: this CTA's sums to its slot, then the tile's count
    float* mine = spill + ((size_t)blockIdx.x * 2 + part) * SPILL_FLOATS + (size_t)wr * (TM * MT * 4 * 32) + lane;
    if (wk == 0)
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[((t * MT + j) * 4 + e) * 32] = acc[t][j][e];
    __threadfence();
    __syncthreads();
    // the tile's CTAs: those whose runs hold its first and last unit
    const u64 units = (u64)TILES * STAGES_K;
    const u32 first = (u32)((((u64)tile * STAGES_K + 1) * SK - 1) / units);
    const u32 last = (u32)((((u64)tile + 1) * STAGES_K * SK - 1) / units);
    if (threadIdx.x == 0) {
      const u32 seen = atomicAdd(counters + tile, 1u);
      counted_last = seen == last - first;
      if (counted_last) counters[tile] = 0u;  // for the next launch
    }
    __syncthreads();
    if (!counted_last) return;
    __threadfence();
    if (wk > 0) return;
    // the parts in their CTAs' order, whichever counted last (its own from registers)
    float sum[TM][MT][4] = {};
    for (u32 p = first; p <= last; ++p) {
      // a CTA's slot of this tile: 0 where its run starts in it
      const u32 slot = (u32)((u64)p * units / SK / STAGES_K) == tile ? 0u : 1u;
      const float* theirs = spill + ((size_t)p * 2 + slot) * SPILL_FLOATS + (size_t)wr * (TM * MT * 4 * 32) + lane;
#pragma unroll
      for (int t = 0; t < TM; ++t)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sum[t][j][e] += p == blockIdx.x ? acc[t][j][e] : __ldcg(theirs + ((t * MT + j) * 4 + e) * 32);
    }
#pragma unroll
    for (int t = 0; t < TM; ++t)
#pragma unroll
      for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][j][e] = sum[t][j][e];
  }
  if (wk > 0) return;
#endif
  // C's lane: rows q (e 0, 1) and q + 8 (e 2, 3) of the tile, X's rows 8 j + 2c and + 1
  if (KS > 1) {  // the part's sums of every W row (gate's and up's), for the adding launch
    float* part = reinterpret_cast<float*>(out) + (size_t)blockIdx.y * M * N;
#pragma unroll
    for (int t = 0; t < TM; ++t)
#pragma unroll
      for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 8 * j + 2 * (int)c + e % 2;
          const u32 col = GATED ? (t % 2) * (N / 2) + tile_base + (t / 2) * 16 + q + (e / 2) * 8
                                : tile_base + t * 16 + q + (e / 2) * 8;
          const u32 end = GATED ? (t % 2 + 1) * (N / 2) : N;
          if (col < end && row < M) part[(size_t)row * N + col] = acc[t][j][e];
        }
    return;
  }
  u16* y = reinterpret_cast<u16*>(out);
#pragma unroll
  for (int t = 0; t < HT; ++t)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const u32 col = tile_base + t * 16 + q + (e / 2) * 8;  // Y's column (a W row, or gate's)
        const int row = 8 * j + 2 * (int)c + e % 2;
        if (col >= (u32)OUT_N || row >= M) continue;
        float v;
        if (GATED) {
          const float gv = acc[2 * t][j][e], uv = acc[2 * t + 1][j][e];
          v = gv / (1.0f + __expf(-gv)) * uv;
        } else {
          v = acc[t][j][e];
        }
        if (RESID) v += h2f(residual[(size_t)row * OUT_N + col]);
        y[(size_t)row * OUT_N + col] = f2h(v);
      }
#if SK > 0
  };
  // this CTA's run of (tile, stage) units, a tile's share at a time
  const u64 units = (u64)TILES * STAGES_K;
  const u32 u_begin = (u32)((u64)blockIdx.x * units / SK), u_end = (u32)((u64)(blockIdx.x + 1) * units / SK);
  for (u32 u = u_begin; u < u_end;) {
    const u32 tile = u / STAGES_K, s0 = u % STAGES_K, s1 = min((u32)STAGES_K, s0 + (u_end - u));
    segment(tile, s0, s1 - s0, s0 == 0 && s1 == (u32)STAGES_K ? -1 : (u == u_begin ? 0 : 1));
    u += s1 - s0;
    __syncthreads();  // every warp done with the ring and the K warps' sums: the next tile's copies
  }
#else
  }
#endif
}
