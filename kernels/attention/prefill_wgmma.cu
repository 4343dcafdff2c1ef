// Prefill attention on Hopper's warpgroup MMA (wgmma): a native CUDA variant beside the portable
// prefill_attention.metal (DESIGN.md: research variants may exist beside the portable body; this
// one has no Metal twin). Same contract: the T query tokens of a prompt, at positions
// pos .. pos+T-1, against a cache that already holds their K and V (fp16), causal, fp32 softmax
// and sums; the same inputs, so the host hands either kernel the same arrays.
//
// FlashAttention-3's consumer schedule without its producer warps: a CTA of two warpgroups takes
// BM = 128 query rows of one head (64 a warpgroup; the heaviest tiles first) and walks its kv
// head's keys in tiles of BN = 128. Every thread copies its share of tile j+1 with cp.async into
// one of three shared stages while tile j is used; an mbarrier a stage says when a tile is in
// (each thread's copies arrive on it), another when both warpgroups are done with it. Per tile j
// a warpgroup
//   issues S_j = Q K_j^T (Q and K from shared memory, both K-major) and O += P_{j-1} V_{j-1} (P
//     from registers: S's accumulator layout is the A operand's), then hands the tensor cores to
//     the other warpgroup (named barriers: the two alternate, so one's softmax runs under the
//     other's products);
//   runs the online softmax on S_j's accumulators (a row lives in the 4 lanes of a quad) while
//     its P V product finishes; then rescales O and packs P_j to fp16.
// Q's tile and contiguous K/V tiles are stored in the 128-byte swizzle the descriptors name (a
// 16-byte piece c of row r at r * 128 + ((c ^ r % 8) * 16) within 64-column blocks of the row), so
// that both the copies and the tensor cores' reads spread over all banks.
// The cache layout is a switch (PAGED):
//  0  contiguous, head-major k/v_cache[1, Hkv, S, D]: V tiles as [key][D] (MN-major for P V);
//  1  paged as vLLM: k_cache[blocks, Hkv, D/8, BS, 8], v_cache[blocks, Hkv, D, BS]; key t in
//     block table[t / BS] at offset t % BS. A block's K (or V) for one head is one run of D * BS
//     halves, copied in order: consecutive threads take consecutive 16-byte pieces, so that a
//     warp's copies are contiguous on both sides. Where a cp.async's destinations fall on the
//     same banks, the two halves of a 32-byte sector are fetched apart (Nsight Compute: 9x the
//     L2 requests of the contiguous kernel, the L2's tag lookups 66-71% busy), so every
//     128-byte line of a run lands in one 128-byte line of shared memory:
//       K tile  [D/8][BN keys][8 dims]   unswizzled core matrices (8x8, 128 contiguous bytes,
//               K-major): a block's piece (d8, key) at d8 * BN * 16 + key * 16;
//       V tile  [BN / VW][D][VW keys]    a run's rows (one dimension, BS keys) as they are, up
//               to VW = min(BS, 64) keys a row, in the swizzle of that row width (none at 16
//               bytes, else 32, 64 or 128): the K-major B operand of P V.
// Keys past the last row's position are not read: cp.async fills them with zeros (unused cache
// slots may hold anything, and 0 * NaN would spoil a sum); their scores are masked.
// ROPE 1 (contiguous, one query tile: T <= BM) folds the launch before it into this one: q is the
// prompt's fused projection rows qkv[T, (Hq + 2 Hkv) * D], unrotated, and each CTA turns its Q
// rows (HEAD_NORM: each head's RMSNorm first, Qwen3's) into Q's tile itself, and writes the
// prompt's K rows (normed, turned) and V rows of its kv head into the cache before its first key
// tile. The Hq / Hkv CTAs of a kv head all write the same bytes: none waits on another, and a row
// this CTA reads after its own write (__syncthreads orders its threads' stores before their
// cp.async reads) can only hold those bytes. NEOX: split-half pairs, else adjacent.
// Constants (NVRTC -D): HEAD_DIM (64 or 128), PAGED (0, 1), BLOCK_SIZE (paged; 8, 16, 32, 64, 128),
// ROPE, NEOX, HEAD_NORM (0, 1), ENTRY (the symbol: kernels.native names each instantiation).
// Inputs: q[T, Hq, D] (ROPE: qkv), k_cache, v_cache, table (int32; paged, else any array: not
//   read), after (ordering token, not read); ROPE: inv_freq (f32[D/2]), q_norm, k_norm (f32[D];
//   any array without HEAD_NORM). Output: out[T, Hq, D] (fp16). Scalars (kernel parameters, so
//   that a CTA's first copies wait on no load): Hkv, S or MAXB, T, pos, Hq, query tiles, and the
//   scale's bits (MLX 0.32.4's precompiled_cuda_kernel refuses a Python float); ROPE: the bits of
//   freq_scale and of the norms' eps.
// Launch: (Hq, tiles) CTAs of 256 threads, SMEM_BYTES dynamic.
typedef unsigned int u32;
typedef unsigned long long u64;
#ifndef ROPE  // (the plain form's instances name only HEAD_DIM, PAGED and BLOCK_SIZE)
#define ROPE 0
#define NEOX 0
#define HEAD_NORM 0
#endif

constexpr int D = HEAD_DIM;
constexpr int BM = 128, BN = 128;            // query rows a CTA, keys a tile
constexpr int THREADS = 256;                 // two warpgroups
constexpr int CHUNKS = D / 8;                // 16-byte pieces of a row
constexpr int Q_BYTES = BM * D * 2;
constexpr int TILE_BYTES = BN * D * 2;       // one K or V tile
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int STAGES = 3;
constexpr int OREGS = D / 2;                 // O's accumulators a thread
constexpr int SREGS = BN / 2;                // S's
static_assert(D == 64 || D == 128, "prefill_wgmma: D is 64 or 128");
static_assert(!PAGED || (BLOCK_SIZE % 8 == 0 && BN % BLOCK_SIZE == 0),
              "prefill_wgmma: paged blocks hold whole 8-key pieces, and a tile whole blocks");
static_assert(BN * CHUNKS % THREADS == 0 && BM * CHUNKS % THREADS == 0, "prefill_wgmma: whole copy rounds");
static_assert(!ROPE || !PAGED, "prefill_wgmma: RoPE and the K/V write fold into the contiguous form only");
#if ROPE
typedef unsigned short cache_t;  // written: the prompt's K and V rows
#else
typedef const unsigned short cache_t;
#endif
#if PAGED
// V's rows in shared memory (see the layout above): VW keys, VROW bytes, the swizzle mode of the
// descriptor (0 none, 3: 32-byte, 2: 64-byte, 1: 128-byte) and its XOR mask of 16-byte pieces.
constexpr int VW = BLOCK_SIZE < 64 ? BLOCK_SIZE : 64;
constexpr int VROW = 2 * VW;
constexpr int VMODE = VROW == 16 ? 0 : VROW == 32 ? 3 : VROW == 64 ? 2 : 1;
constexpr u32 VXOR = VROW / 16 - 1;
#endif
constexpr int BARRIERS_AT = Q_BYTES + STAGES * STAGE_BYTES;  // full[STAGES], then empty[STAGES]
#define SMEM_BYTES (BARRIERS_AT + 2 * STAGES * 8 + 1024)  // + slack to align the base to 1024

__device__ __forceinline__ u32 shared_address(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// One 16-byte piece global -> shared; bytes < 16 copies that many and zeros the rest. Tiles
// before the one holding the last key copy whole pieces (TAIL false): no bound to work out.
template <bool TAIL>
__device__ __forceinline__ void copy16(u32 dst, const void* src, u32 bytes) {
  if (TAIL)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// mbarriers: a tile's copies arrive on its stage's `full` barrier as they land (each thread's, once
// all its earlier copies have); each warp arrives on `empty` when its warpgroup is done with it.
__device__ __forceinline__ void barrier_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void copies_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// The two warpgroups' turns at the tensor cores: named barriers 1 and 2 (0 is __syncthreads).
__device__ __forceinline__ void turn_wait(u32 wg) { asm volatile("bar.sync %0, 256;\n" ::"r"(wg + 1) : "memory"); }
__device__ __forceinline__ void turn_pass(u32 wg) { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory"); }

// The offset of piece c (16 bytes) of row r in a tile of `rows` rows, 128-byte swizzled.
__device__ __forceinline__ u32 swizzled(u32 rows, u32 r, u32 c) {
  return (c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) << 4);
}

// One thread's share of a K/V tile's copies (keys k0 .. k0 + BN - 1 of kv head h) into shared
// memory at ks and vs. TAIL: the tile holds the last key (kv_end - 1), and pieces past it are
// zeros; the tiles before it copy whole pieces with no bound to check.
template <bool TAIL>
__device__ __forceinline__ void copy_tile(u32 tid, u32 ks, u32 vs, u32 k0, u32 kv_end, u32 h, u32 n_kv,
                                          u32 rows, u32 blocks, const unsigned short* __restrict__ k_cache,
                                          const unsigned short* __restrict__ v_cache) {
#if PAGED
  // A block's K and V runs for head h, in order (see the layout above); the tile's blocks come
  // one a lane in `blocks` (lane b: the tile's block b).
  (void)rows;
  constexpr u32 RUN = D * BLOCK_SIZE / 8;  // 16-byte pieces of one block's run
#pragma unroll
  for (u32 it = 0; it < D * BN / 8 / THREADS; ++it) {
    const u32 i = tid + it * THREADS, b = i / RUN, w = i % RUN;
    const u32 blk = __shfl_sync(0xffffffffu, blocks, b);
    const unsigned long long run = ((unsigned long long)blk * n_kv + h) * D * BLOCK_SIZE + w * 8;
    const u32 d8 = w / BLOCK_SIZE, key = b * BLOCK_SIZE + w % BLOCK_SIZE;       // K: [D/8][BS][8]
    copy16<TAIL>(ks + d8 * BN * 16 + key * 16, k_cache + run, k0 + key < kv_end ? 16 : 0);
    const u32 d = w / (BLOCK_SIZE / 8), kp = b * BLOCK_SIZE + (w % (BLOCK_SIZE / 8)) * 8;  // V: [D][BS]
    const u32 n = TAIL && k0 + kp < kv_end ? min(kv_end - k0 - kp, 8u) : 0u;
    const u32 at = d * VROW + (kp % VW) * 2;  // within its group of VW keys, then swizzled
    copy16<TAIL>(vs + (kp / VW) * D * VROW + (at ^ (((at >> 7) & VXOR) << 4)), v_cache + run, n * 2);
  }
#else
  (void)n_kv;
  (void)blocks;
#pragma unroll
  for (u32 it = 0; it < BN * CHUNKS / THREADS; ++it) {
    const u32 i = tid + it * THREADS, r = i / CHUNKS, c = i % CHUNKS, key = k0 + r;
    const bool in = !TAIL || key < kv_end;
    const unsigned long long src = ((unsigned long long)h * rows + (in ? key : 0u)) * D + c * 8;
    copy16<TAIL>(ks + swizzled(BN, r, c), k_cache + src, in ? 16 : 0);
    copy16<TAIL>(vs + swizzled(BN, r, c), v_cache + src, in ? 16 : 0);
  }
#endif
}

#if ROPE
// One thread's 16 values of a head row, pieces c and c + CHUNKS / 2 (so that a NeoX pair, i and
// i + D / 2, is in one thread), as RMSNorm (HEAD_NORM) then RoPE at position p give them, in
// fp16; kernels/rope/head_norm_rope_kv_write.metal's arithmetic. The CHUNKS / 2 threads of a row
// are adjacent lanes (the sum of squares goes round them), and every lane of the warp calls this.
constexpr int HALF = CHUNKS / 2;
union Piece {
  uint4 u;
  unsigned short h[8];
};
__device__ __forceinline__ float widen(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short narrow(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ void turn_row(Piece& a, Piece& b, u32 c, float p, const float* __restrict__ inv_freq,
                                         const float* __restrict__ weight, float eps) {
  float x[16];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    x[e] = widen(a.h[e]);
    x[8 + e] = widen(b.h[e]);
  }
  // element e of the 16 sits at dimension at(e); NeoX pairs are (e, e + 8), adjacent ones (2f, 2f + 1)
  auto at = [&](int e) { return (e < 8 ? c * 8 : D / 2 + c * 8) + (e % 8); };
#if HEAD_NORM
  float ss = 0.0f;
#pragma unroll
  for (int e = 0; e < 16; ++e) ss += x[e] * x[e];
#pragma unroll
  for (int m = 1; m < HALF; m *= 2) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float inv_rms = rsqrtf(ss / float(D) + eps);
#pragma unroll
  for (int e = 0; e < 16; ++e) x[e] = x[e] * inv_rms * weight[at(e)];
#else
  (void)weight;
  (void)eps;
#endif
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const int e0 = NEOX ? f : 2 * f, e1 = NEOX ? f + 8 : 2 * f + 1;
    const u32 pair = NEOX ? at(e0) : at(e0) / 2;
    float s, co;
    sincosf(p * inv_freq[pair], &s, &co);
    const float x0 = x[e0], x1 = x[e1];
    x[e0] = x0 * co - x1 * s;
    x[e1] = x0 * s + x1 * co;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    a.h[e] = narrow(x[e]);
    b.h[e] = narrow(x[8 + e]);
  }
}
#endif

// A shared-memory matrix descriptor: start address, leading-dimension byte offset (swizzled
// MN-major: from one 64-element block of the MN dimension to the next; unswizzled K-major: from
// one core matrix to the next along K), stride byte offset (from one 8-row group to the next),
// and the layout (bits 62-63): 1 the 128-byte swizzle, 2 the 64-byte, 3 the 32-byte, 0 none.
__device__ __forceinline__ u64 descriptor(u32 address, u32 lbo, u32 sbo, u32 mode = 1) {
  return (u64)((address & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
         ((u64)((sbo >> 4) & 0x3FFF) << 32) | ((u64)mode << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from moving accesses to accumulators across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The products: one wgmma instruction at the widths used (N = 128: S, and P V at D = 128; N = 64:
// P V at D = 64), A from shared memory (S) or from registers (P V). Inline asm takes its operand
// lists spelled out, one per accumulator register, hence three wrappers of the same shape.
// D[64 x 64] += A[64 x 16] B[16 x 64], A in registers (laid out as the accumulator is), B in
// shared memory, K-major (TRANS_B 0) or MN-major (TRANS_B 1).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32 (&a)[4], u64 b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(TRANS_B));
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B in shared memory (descriptors, both K-major);
// accumulate 0 overwrites D.
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 a, u64 b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

// D[64 x 128] += A[64 x 16] B[16 x 128], A in registers (laid out as the accumulator is), B in
// shared memory, K-major (TRANS_B 0) or MN-major (TRANS_B 1).
template <int TRANS_B>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32 (&a)[4], u64 b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1), "n"(TRANS_B));
}

#define WGMMA_PV_(n) wgmma_rs_n##n
#define WGMMA_PV_N(n) WGMMA_PV_(n)
#define WGMMA_PV WGMMA_PV_N(HEAD_DIM)

extern "C" __global__ void __launch_bounds__(THREADS, 1)
ENTRY(const unsigned short* __restrict__ q, cache_t* __restrict__ k_cache, cache_t* __restrict__ v_cache,
      const int* __restrict__ table, const void* after,
#if ROPE
      const float* __restrict__ inv_freq, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
#endif
      unsigned short* __restrict__ out, const u32 n_kv, const u32 rows, const u32 n_tok, const u32 pos,
      const u32 n_heads, const u32 q_tiles, const int scale_bits
#if ROPE
      , const int freq_scale_bits, const int eps_bits
#endif
) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const u32 q_s = (shared_address(smem) + 1023) & ~1023u;  // the swizzle is of address bits: 1024-aligned
  const u32 full = q_s + BARRIERS_AT, empty = full + STAGES * 8;
  const u32 tid = threadIdx.x % THREADS;  // (known < THREADS: a copy's block and offset fold)
  const u32 wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  // Every head's heaviest tile first (CTAs start in x order), a kv head's query heads adjacent.
  const u32 hq = blockIdx.x, h = hq / (n_heads / n_kv);
  const u32 q0 = (q_tiles - 1 - blockIdx.y) * BM;
  const u32 kv_end = pos + min(q0 + BM, n_tok);  // keys the tile's last row sees
  const u32 n_tiles = (kv_end + BN - 1) / BN;
  const float scale_log2 = __int_as_float(scale_bits) * 1.4426950408889634f;

#if ROPE
  // Q's rows turned into its tile (zeros past the prompt), then the prompt's K and V rows of kv
  // head h into the cache: rounds of THREADS / HALF rows, a row's HALF threads adjacent. A round
  // is uniform over the CTA (the norm's shuffles need whole warps).
  {
    constexpr u32 ROUND = THREADS / HALF;
    const u32 r_in = tid / HALF, c = tid % HALF, stride = (n_heads + 2 * n_kv) * D;
    const float freq_scale = __int_as_float(freq_scale_bits), eps = __int_as_float(eps_bits);
    const uint4* src = reinterpret_cast<const uint4*>(q);
#pragma unroll
    for (u32 r0 = 0; r0 < BM; r0 += ROUND) {
      const u32 r = r0 + r_in, t = q0 + r;
      Piece a, b;
      a.u = b.u = make_uint4(0, 0, 0, 0);
      if (q0 + r0 < n_tok) {
        const u32 at = (min(t, n_tok - 1) * stride + hq * D) / 8 + c;  // (a row past the prompt: discarded)
        a.u = src[at];
        b.u = src[at + HALF];
        turn_row(a, b, c, float(pos + t) * freq_scale, inv_freq, q_norm, eps);
        if (t >= n_tok) a.u = b.u = make_uint4(0, 0, 0, 0);
      }
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(q_s + swizzled(BM, r, c)), "r"(a.u.x),
                   "r"(a.u.y), "r"(a.u.z), "r"(a.u.w) : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(q_s + swizzled(BM, r, c + HALF)), "r"(b.u.x),
                   "r"(b.u.y), "r"(b.u.z), "r"(b.u.w) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // Q's tile, for the tensor cores
    const u32 new_rows = kv_end - pos;
    for (u32 r0 = 0; r0 < new_rows; r0 += ROUND) {
      const u32 t = min(r0 + r_in, new_rows - 1);  // (a row past them: discarded)
      const u32 at = (t * stride + (n_heads + h) * D) / 8 + c;
      Piece a, b, va, vb;
      a.u = src[at];
      b.u = src[at + HALF];
      va.u = src[at + n_kv * D / 8];
      vb.u = src[at + n_kv * D / 8 + HALF];
      turn_row(a, b, c, float(pos + t) * freq_scale, inv_freq, k_norm, eps);
      if (r0 + r_in < new_rows) {
        const unsigned long long row = ((unsigned long long)h * rows + pos + t) * D / 8 + c;
        uint4* kd = reinterpret_cast<uint4*>(k_cache);
        uint4* vd = reinterpret_cast<uint4*>(v_cache);
        kd[row] = a.u;
        kd[row + HALF] = b.u;
        vd[row] = va.u;
        vd[row + HALF] = vb.u;
      }
    }
  }
#else
  // Q's rows (rows past the prompt are zeros: computed, never written), before anything else: the
  // copies need no barrier until their arrival, which tile 0's (after the barriers' set-up) counts.
#pragma unroll
  for (u32 it = 0; it < BM * CHUNKS / THREADS; ++it) {
    const u32 i = tid + it * THREADS, r = i / CHUNKS, c = i % CHUNKS, t = q0 + r;
    const bool in = t < n_tok;
    copy16<true>(q_s + swizzled(BM, r, c), q + ((unsigned long long)(in ? t : 0) * n_heads + hq) * D + c * 8, in ? 16 : 0);
  }
#endif

#if PAGED
  // The table's entries of a tile (lane l: its block l % NB), read a tile before its copies so
  // that they never wait on the load; 0 (any block: nothing is read) past the last key.
  constexpr u32 NB = BN / BLOCK_SIZE;
  auto entries = [&](u32 j) {
    const u32 e = j * NB + lane % NB;
    return e * BLOCK_SIZE < kv_end ? u32(table[e]) : 0u;
  };
  u32 next_blocks = entries(0);
#endif

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + s * 8, THREADS);  // every thread's copies
      barrier_init(empty + s * 8, 8);       // every warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // (ROPE: also the prompt's K and V rows, written, before any thread copies them)

  // This thread's share of tile j's K and V into stage j % STAGES, once both warpgroups are done
  // with the tile that was there; its arrival on the stage's `full` barrier when they land.
  auto issue = [&](u32 j) {
    const u32 stage = j % STAGES;
    if (j >= STAGES) barrier_wait(empty + stage * 8, (j / STAGES - 1) & 1);
    const u32 k0 = j * BN, ks = q_s + Q_BYTES + stage * STAGE_BYTES, vs = ks + TILE_BYTES;
#if PAGED
    const u32 blocks = next_blocks;
    if (j + 1 < n_tiles) next_blocks = entries(j + 1);
#else
    const u32 blocks = 0;  // (no table)
#endif
    if (k0 + BN <= kv_end)
      copy_tile<false>(tid, ks, vs, k0, kv_end, h, n_kv, rows, blocks, k_cache, v_cache);
    else
      copy_tile<true>(tid, ks, vs, k0, kv_end, h, n_kv, rows, blocks, k_cache, v_cache);
    copies_arrive(full + stage * 8);
  };
  // Tile j is in (and visible to the tensor cores, which read through the async proxy).
  auto arrived = [&](u32 j) {
    barrier_wait(full + (j % STAGES) * 8, (j / STAGES) & 1);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  };

  issue(0);  // (its arrival counts Q's copies too)

  // This thread's two rows of the CTA (row_a, row_a + 8: the accumulator layout) and positions.
  const u32 row_a = wg * 64 + warp * 16 + lane / 4;
  const u32 last = pos + n_tok - 1;
  const u32 pos_a = min(pos + q0 + row_a, last), pos_b = min(pos + q0 + row_a + 8, last);
  const u32 wg_first = min(pos + q0 + wg * 64, last);
  const float NEG_INF = __int_as_float(0xff800000);
  float o[OREGS], s[SREGS];
  u32 p[BN / 16][4];
#pragma unroll
  for (int i = 0; i < OREGS; ++i) o[i] = 0.0f;
  float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;  // l: this thread's part of the row sums

  auto issue_scores = [&](u32 j) {  // S = Q K_j^T
    const u32 ks = q_s + Q_BYTES + (j % STAGES) * STAGE_BYTES;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const u64 a = descriptor(q_s + (kk / 4) * BM * 128 + wg * 64 * 128 + (kk % 4) * 32, 16, 1024);
#if PAGED  // K as [D/8][BN][8]: core matrices 128 bytes apart along the keys, BN * 16 along D
      const u64 b = descriptor(ks + kk * 2 * BN * 16, BN * 16, 128, 0);
#else
      const u64 b = descriptor(ks + (kk / 4) * BN * 128 + (kk % 4) * 32, 16, 1024);
#endif
      wgmma_ss_n128(s, a, b, kk > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](u32 j) {  // O += P V_j
    const u32 vs = q_s + Q_BYTES + (j % STAGES) * STAGE_BYTES + TILE_BYTES;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#if PAGED  // V as [BN/VW][D][VW]: keys 16kk.. start in group 16kk / VW; 8-row groups 8 * VROW
           // apart; with VW = 8 (no swizzle) the second 8 keys are the next group, D * 16 on
           // (the leading offset; a swizzled row holds all 16 keys and has none)
      WGMMA_PV<0>(o, p[kk], descriptor(vs + (16 * kk / VW) * D * VROW + (16 * kk % VW) * 2,
                                       VMODE ? 16 : D * 16, 8 * VROW, VMODE));
#else      // V as [keys][D]: MN-major, 64-dimension blocks BN rows apart
      WGMMA_PV<1>(o, p[kk], descriptor(vs + kk * 16 * 128, BN * 128, 1024));
#endif
    }
    wgmma_commit();
  };
  // The online softmax in base 2 on S_j's accumulators, in place: element 4n + e is row a (e < 2)
  // or b, key k0 + 8n + 2 (lane % 4) + e % 2. Leaves P_j (fp32) in s; returns nothing, sets the
  // rows' alphas (the factor O's sums so far take).
  float alpha_a, alpha_b;
  // The running maxima are of the unscaled scores (scale > 0): the scale goes into exp2's
  // argument, one FFMA an element.
  auto softmax = [&](u32 j) {
    const u32 k0 = j * BN;
    if (k0 + BN - 1 > wg_first) {  // a tile that reaches past some row's position
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        const u32 key = k0 + n * 8 + (lane % 4) * 2;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key + (e & 1) > (e < 2 ? pos_a : pos_b)) s[4 * n + e] = NEG_INF;
      }
    }
    float max_a = NEG_INF, max_b = NEG_INF;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      max_a = fmaxf(max_a, fmaxf(s[4 * n], s[4 * n + 1]));
      max_b = fmaxf(max_b, fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
    max_a = fmaxf(max_a, __shfl_xor_sync(0xffffffffu, max_a, 1));
    max_a = fmaxf(max_a, __shfl_xor_sync(0xffffffffu, max_a, 2));
    max_b = fmaxf(max_b, __shfl_xor_sync(0xffffffffu, max_b, 1));
    max_b = fmaxf(max_b, __shfl_xor_sync(0xffffffffu, max_b, 2));
    // Tile 0 holds key 0, which every row sees: the running max is finite from there on (a
    // warpgroup's rows may all lie before a tile: all its scores masked, its P zeros).
    const float new_a = fmaxf(m_a, max_a), new_b = fmaxf(m_b, max_b);
    alpha_a = exp2_approx((m_a - new_a) * scale_log2);
    alpha_b = exp2_approx((m_b - new_b) * scale_log2);
    m_a = new_a;
    m_b = new_b;
    const float off_a = -new_a * scale_log2, off_b = -new_b * scale_log2;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
      s[4 * n] = exp2_approx(fmaf(s[4 * n], scale_log2, off_a));
      s[4 * n + 1] = exp2_approx(fmaf(s[4 * n + 1], scale_log2, off_a));
      s[4 * n + 2] = exp2_approx(fmaf(s[4 * n + 2], scale_log2, off_b));
      s[4 * n + 3] = exp2_approx(fmaf(s[4 * n + 3], scale_log2, off_b));
      sum_a += s[4 * n] + s[4 * n + 1];
      sum_b += s[4 * n + 2] + s[4 * n + 3];
    }
    l_a = l_a * alpha_a + sum_a;
    l_b = l_b * alpha_b + sum_b;
  };
  // O's sums rescaled to the new maxima, and P_j packed as the A operand (keys 16kk.. of rows a
  // and b are S's blocks 2kk and 2kk + 1), once the P V product that read the last P is done.
  auto rescale_and_pack = [&]() {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[4 * n] *= alpha_a;
      o[4 * n + 1] *= alpha_a;
      o[4 * n + 2] *= alpha_b;
      o[4 * n + 3] *= alpha_b;
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      p[kk][0] = pack_half2(s[8 * kk], s[8 * kk + 1]);
      p[kk][1] = pack_half2(s[8 * kk + 2], s[8 * kk + 3]);
      p[kk][2] = pack_half2(s[8 * kk + 4], s[8 * kk + 5]);
      p[kk][3] = pack_half2(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto done_with = [&](u32 j) {  // this warp no longer reads tile j
    __syncwarp();
    if (lane == 0) barrier_arrive(empty + (j % STAGES) * 8);
  };

  // Turns: warpgroup 0 goes first; each passes the turn after issuing its products, n_tiles + 1
  // times (S_0; S_j with P_{j-1} V_{j-1}; P_{n-1} V_{n-1}), warpgroup 1's last pass left out so
  // that every arrival is matched.
  if (wg == 1) turn_pass(wg);
  if (n_tiles > 1) issue(1);
  arrived(0);
  turn_wait(wg);
  wgmma_fence();
  issue_scores(0);
  turn_pass(wg);
  wgmma_wait<0>();
  pin(s);
  softmax(0);
  rescale_and_pack();
  for (u32 j = 1; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) issue(j + 1);
    arrived(j);
    turn_wait(wg);
    wgmma_fence();
    issue_scores(j);
    issue_pv(j - 1);
    turn_pass(wg);
    wgmma_wait<1>();
    pin(s);
    softmax(j);
    wgmma_wait<0>();
    pin(o);
    done_with(j - 1);
    rescale_and_pack();
  }
  turn_wait(wg);
  wgmma_fence();
  issue_pv(n_tiles - 1);
  if (wg == 0) turn_pass(wg);
  wgmma_wait<0>();
  pin(o);

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
  const float inv_a = 1.0f / l_a, inv_b = 1.0f / l_b;
  const u32 t_a = q0 + row_a, t_b = t_a + 8;
  u32* out_a = reinterpret_cast<u32*>(out + ((unsigned long long)t_a * n_heads + hq) * D);
  u32* out_b = reinterpret_cast<u32*>(out + ((unsigned long long)t_b * n_heads + hq) * D);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const u32 col = n * 4 + lane % 4;  // pairs of halves
    if (t_a < n_tok) out_a[col] = pack_half2(o[4 * n] * inv_a, o[4 * n + 1] * inv_a);
    if (t_b < n_tok) out_b[col] = pack_half2(o[4 * n + 2] * inv_b, o[4 * n + 3] * inv_b);
  }
}
