// Stage one chunk of X' in threadgroup memory as int16 with one scale per block of 32 (1/32767
// of the block's largest magnitude) and the sum of the block's int16 values (Q4_0 takes its -8
// off as 8 * that sum). X' is X, RMSNorm(X) * gamma (LATHE_PROLOGUE 1) or silu(gate) * up of
// X = [gate | up] (2), computed here: no normalized or activated copy in device memory.
// Shared by the v2 and v3 GEMVs, which differ only in where the values go: the includer's
// X_STORE(m, e, packed) stores the 16 values of row m from value e of the chunk (a multiple of
// 16), packed two to a uint (packed[0] = values e, e + 1, ...).
// The scope names: x, k, nb, gamma and eps (prologue 1), tid, NT, M, XCHUNK, cb0 (the chunk's
// first block), x_scale and x_sum (M * XCHUNK / 32 each), inv_rms, scratch, simd, lane.
// Every thread of the threadgroup runs it; it begins and ends with a threadgroup barrier.
{
#if LATHE_PROLOGUE == 1
  if (cb0 == 0) {
    // RMSNorm needs the mean square of each whole row of X first.
    for (uint m = 0; m < uint(M); ++m) {
      float ss = 0.0f;
      for (uint i = tid; i < k / 8; i += NT) {
        const uint4 v = load_wide<uint4>(x + m * k, i);
        const uint u[4] = {v.x, v.y, v.z, v.w};
        for (uint j = 0; j < 4; ++j) {
          const half2 hx = as_type<half2>(u[j]);
          ss += float(hx.x) * float(hx.x) + float(hx.y) * float(hx.y);
        }
      }
      const float total = threadgroup_sum<NSIMD>(ss, scratch, simd, lane);
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
  for (uint base = 0; base < halves; base += NT) {
    const uint i = base + tid;
    const uint m = i / (cnb * 2);
    const uint e = (i % (cnb * 2)) * 16;  // first value of the item within the chunk
    float v[16] = {};
    float amax = 0.0f;
    if (i < halves) {
      const uint k0 = cb0 * 32 + e;
#if LATHE_PROLOGUE == 2
      const auto src = x + m * 2 * k;  // gate; up follows K values later
#else
      const auto src = x + m * k;
#endif
      for (uint q = 0; q < 2; ++q) {
        const uint4 g = load_wide<uint4>(src, k0 / 8 + q);
        const uint gw[4] = {g.x, g.y, g.z, g.w};
#if LATHE_PROLOGUE == 1
        const uint4 s4 = load_wide<uint4>(gamma, k0 / 8 + q);
        const uint sw[4] = {s4.x, s4.y, s4.z, s4.w};
#elif LATHE_PROLOGUE == 2
        const uint4 u4 = load_wide<uint4>(src + k, k0 / 8 + q);
        const uint uw[4] = {u4.x, u4.y, u4.z, u4.w};
#endif
        for (uint j = 0; j < 4; ++j) {
          const half2 h = as_type<half2>(gw[j]);
          float a = float(h.x), b = float(h.y);
#if LATHE_PROLOGUE == 1
          const half2 gm = as_type<half2>(sw[j]);
          a = a * inv_rms[m] * float(gm.x);
          b = b * inv_rms[m] * float(gm.y);
#elif LATHE_PROLOGUE == 2
          const half2 uh = as_type<half2>(uw[j]);
          a = a / (1.0f + exp(-a)) * float(uh.x);
          b = b / (1.0f + exp(-b)) * float(uh.y);
#endif
          v[q * 8 + 2 * j] = a;
          v[q * 8 + 2 * j + 1] = b;
          amax = max(amax, max(fabs(a), fabs(b)));
        }
      }
    }
    // The block's two halves meet: one scale for the block.
    amax = max(amax, simd_shuffle_xor(amax, 1));
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    int sum = 0;
    if (i < halves) {
      uint packed[8];
      for (uint j = 0; j < 8; ++j) {
        const int a = int(rint(v[2 * j] * inv)), b = int(rint(v[2 * j + 1] * inv));
        sum += a + b;
        packed[j] = (uint(a) & 0xffffu) | (uint(b) << 16);
      }
      X_STORE(m, e, packed);
    }
    sum += simd_shuffle_xor(sum, 1);
    if (i < halves && i % 2 == 0) {
      const uint blk = m * (XCHUNK / 32) + e / 32;
      x_scale[blk] = amax / 32767.0f;
      x_sum[blk] = sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
