// Stage one chunk of X' in threadgroup memory as int16 with one scale per block of 32 (1/32767
// of the block's largest magnitude) and the sum of the block's int16 values (Q4_0 takes its -8
// off as 8 * that sum). X' is X, RMSNorm(X) * gamma (LATHE_PROLOGUE 1) or act(gate) * up of
// X = [gate | up] (2; act: SiLU, or GELU where LATHE_ACT is 1), computed here: no normalized or
// activated copy in device memory.
// Shared by the v2 and v3 GEMVs, which differ only in where the values go: the includer's
// X_STORE(m, e, packed) stores the 16 values of row m from value e of the chunk (a multiple of
// 16), packed two to a uint (packed[0] = values e, e + 1, ...).
// The scope names: x, k, nb, gamma and eps (prologue 1), tid, NT, M, XCHUNK, cb0 (the chunk's
// first block), x_scale and x_sum (M * XCHUNK / 32 each), inv_rms, scratch, simd, lane.
// Every thread of the threadgroup runs it; it begins and ends with a threadgroup barrier.
// X_RMS_LATE (the includer's, LATHE_PROLOGUE 1 with X' in one chunk, K whole 512s or 512 / 2^j):
// no pass over X before the staging. X' is X * gamma, each row's sum of squares comes from the
// staging's own loads into scratch[m * NSIMD + simd] (NSIMD * M floats), and the includer scales
// its sums by 1 / RMS (v3_rows.metal): the codes are the same up to rounding (a block's scale
// absorbs the row's 1 / RMS), and the pass, a round trip to the L2 and M threadgroup sums, leaves
// the ticket's path. A SIMD group's 32 items (16 values each) lie in one row, or in rows of a
// power-of-two number of lanes each: each row's part is summed over its lanes and added by its
// first lane, in pass order (the same bits every launch).
#ifndef LATHE_ACT
#define LATHE_ACT 0
#endif
#ifndef LATHE_X32
#define LATHE_X32 0
#endif
#ifndef X_STAGE_ITEMS
#define X_STAGE_ITEMS 1  // items a thread a pass (the includer's: gemv_x_items, block_x_items)
#endif
// X_EIGHT(p, i, e): values 8i .. 8i + 7 of p into float e[8]; p half, or float where LATHE_X32
// (v3's RMSNorm prologue over a float32 residual stream: Gemma's passes fp16's range).
#if LATHE_X32
#define X_EIGHT(p, i, e)                                                                       \
  {                                                                                            \
    const uint4 lo_ = load_wide<uint4>(p, 2 * (i)), hi_ = load_wide<uint4>(p, 2 * (i) + 1);   \
    e[0] = as_type<float>(lo_.x), e[1] = as_type<float>(lo_.y);                                \
    e[2] = as_type<float>(lo_.z), e[3] = as_type<float>(lo_.w);                                \
    e[4] = as_type<float>(hi_.x), e[5] = as_type<float>(hi_.y);                                \
    e[6] = as_type<float>(hi_.z), e[7] = as_type<float>(hi_.w);                                \
  }
#else
#define X_EIGHT(p, i, e)                                                                       \
  {                                                                                            \
    const uint4 w_ = load_wide<uint4>(p, i);                                                   \
    const uint u_[4] = {w_.x, w_.y, w_.z, w_.w};                                               \
    for (uint j_ = 0; j_ < 4; ++j_) {                                                          \
      const half2 h_ = as_type<half2>(u_[j_]);                                                 \
      e[2 * j_] = float(h_.x), e[2 * j_ + 1] = float(h_.y);                                    \
    }                                                                                          \
  }
#endif
#ifndef X_RMS_LATE
#define X_RMS_LATE false
#define X_RMS_LATE_HERE
#endif
{
#if LATHE_PROLOGUE == 1
  if (X_RMS_LATE && lane == 0) {  // this SIMD group's sums, each row's from zero
    LATHE_UNROLL for (uint m = 0; m < uint(M); ++m) scratch[m * NSIMD + simd] = 0.0f;
  }
  if (!X_RMS_LATE && cb0 == 0) {
    // RMSNorm needs the mean square of each whole row of X first. Every row's loads go out
    // together, and the sums meet after: a row at a time waited an L2 round trip (and two
    // barriers) a row, M of them before the first value was staged.
    float ss[M];
    LATHE_UNROLL for (uint m = 0; m < uint(M); ++m) ss[m] = 0.0f;
    for (uint i = tid; i < k / 8; i += NT) {
      LATHE_UNROLL for (uint m = 0; m < uint(M); ++m) {
        float e[8];
        X_EIGHT(x + m * k, i, e);
        for (uint j = 0; j < 8; ++j) ss[m] += e[j] * e[j];
      }
    }
    LATHE_UNROLL for (uint m = 0; m < uint(M); ++m) {
      const float total = threadgroup_sum<NSIMD>(ss[m], scratch, simd, lane);
      if (tid == 0) inv_rms[m] = rsqrt(total / float(k) + eps[0]);
    }
  }
#endif
  // Every SIMD group is done with the last chunk past this barrier. Items of half a block (16
  // values); the same trip count for every lane, so that the two halves of a block can meet in
  // a shuffle.
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint cnb = min(uint(XCHUNK / 32), nb - cb0);
  const uint halves = M * cnb * 2;
  // X_STAGE_ITEMS items a thread a pass: each item's loads from a valid address (an item past
  // the end reads the last one's and stores nothing), so that none sits behind a branch and all
  // of a pass's go out before the first is used. One item a pass, M rows of a long K took an L2
  // round trip each pass (8 for the batch form's 8 rows of K = 2048).
  for (uint base = 0; base < halves; base += X_STAGE_ITEMS * NT) {
    float v[X_STAGE_ITEMS][16];
    float amax[X_STAGE_ITEMS];
    float item_ss[X_STAGE_ITEMS];  // X_RMS_LATE: the item's sum of squares of X
    LATHE_UNROLL for (uint u = 0; u < X_STAGE_ITEMS; ++u) {
      const uint i = min(base + u * NT + tid, halves - 1);
      const uint m = i / (cnb * 2);
      const uint e = (i % (cnb * 2)) * 16;  // first value of the item within the chunk
      const uint k0 = cb0 * 32 + e;
#if LATHE_PROLOGUE == 2
      const auto src = x + m * 2 * k;  // gate; up follows K values later
#else
      const auto src = x + m * k;
#endif
      amax[u] = 0.0f;
      item_ss[u] = 0.0f;
      LATHE_UNROLL for (uint q = 0; q < 2; ++q) {
        float xe[8];
        X_EIGHT(src, k0 / 8 + q, xe);
#if LATHE_PROLOGUE == 1
        const uint4 s4 = load_wide<uint4>(gamma, k0 / 8 + q);
        const uint sw[4] = {s4.x, s4.y, s4.z, s4.w};
        if (X_RMS_LATE) {
          for (uint j = 0; j < 8; ++j) item_ss[u] += xe[j] * xe[j];
        }
#elif LATHE_PROLOGUE == 2
        const uint4 u4 = load_wide<uint4>(src + k, k0 / 8 + q);
        const uint uw[4] = {u4.x, u4.y, u4.z, u4.w};
#endif
        LATHE_UNROLL for (uint j = 0; j < 4; ++j) {
          float a = xe[2 * j], b = xe[2 * j + 1];
#if LATHE_PROLOGUE == 1
          const half2 gm = as_type<half2>(sw[j]);
          a = (X_RMS_LATE ? a : a * inv_rms[m]) * float(gm.x);
          b = (X_RMS_LATE ? b : b * inv_rms[m]) * float(gm.y);
#elif LATHE_PROLOGUE == 2
          const half2 uh = as_type<half2>(uw[j]);
          a = gate_act<LATHE_ACT>(a) * float(uh.x);
          b = gate_act<LATHE_ACT>(b) * float(uh.y);
#endif
          v[u][q * 8 + 2 * j] = a;
          v[u][q * 8 + 2 * j + 1] = b;
          amax[u] = max(amax[u], max(fabs(a), fabs(b)));
        }
      }
    }
    LATHE_UNROLL for (uint u = 0; u < X_STAGE_ITEMS; ++u) {
      const uint i = base + u * NT + tid;
      const uint m = min(i, halves - 1) / (cnb * 2);
      const uint e = (min(i, halves - 1) % (cnb * 2)) * 16;
#if LATHE_PROLOGUE == 1
      if (X_RMS_LATE) {  // (an item past the end repeats the last one: not counted)
        const uint row_lanes = min(cnb * 2, 32u);  // the lanes a row's items take
        float row_part = item_ss[u];
        for (uint o = 1; o < 32; o <<= 1) {
          if (o < row_lanes) row_part += simd_shuffle_xor(row_part, ushort(o));
        }
        if (lane % row_lanes == 0 && i < halves) scratch[m * NSIMD + simd] += row_part;
      }
#endif
      // The block's two halves meet: one scale for the block (i and i ^ 1 both in or both out).
      const float block_max = max(amax[u], simd_shuffle_xor(amax[u], 1));
      const float inv = code_inv(block_max);
      uint bits = 0;  // the 16 codes' sum, each biased by code_bias() (lathe.h's code_bits)
      uint packed[8];
      LATHE_UNROLL for (uint j = 0; j < 8; ++j) {
        const uint a = code_bits(v[u][2 * j], inv), b = code_bits(v[u][2 * j + 1], inv);
        bits += a + b;
        packed[j] = (a & 0xffffu) | (b << 16);
      }
      int sum = int(bits - 16u * code_bias());
      if (i < halves) {
        X_STORE(m, e, packed);
      }
      sum += simd_shuffle_xor(sum, 1);
      if (i < halves && i % 2 == 0) {
        const uint blk = m * (XCHUNK / 32) + e / 32;
        x_scale[blk] = code_scale(block_max);
        x_sum[blk] = sum;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
#undef X_EIGHT
#ifdef X_RMS_LATE_HERE
#undef X_RMS_LATE
#undef X_RMS_LATE_HERE
#endif
