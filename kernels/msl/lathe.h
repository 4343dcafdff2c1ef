// lathe.h: helpers shared by lathe's MSL bodies, written in the portable MSL subset.
// On CUDA it follows cuda_compat.h; on Metal it is the whole header.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
using namespace metal;
#define LATHE_FN inline

// Pointer helpers with address spaces; cuda_compat.h has their CUDA twins.
// writable: the in-place form of a cache write (DESIGN.md). MLX passes inputs read-only; the
// kernel writes through this view and returns an ordering token that later readers depend on.
template <typename T>
LATHE_FN device T* writable(const device T* p) {
  return const_cast<device T*>(p);
}
// load_wide / store_wide: element i of p viewed as an array of W (uint4: 16-byte accesses).
template <typename W, typename T>
LATHE_FN W load_wide(const device T* p, uint i) {
  return ((const device W*)p)[i];
}
template <typename W, typename T>
LATHE_FN void store_wide(device T* p, uint i, W w) {
  ((device W*)p)[i] = w;
}
#endif

// ---- reductions ----------------------------------------------------------------------------------
// Sum of v over a threadgroup of NSIMD SIMD groups; every thread gets the total. `scratch` is a
// threadgroup array of at least NSIMD floats. It may be reused right after: the trailing barrier
// keeps a later write from racing the reads here. All threads of the threadgroup must call it.
template <uint NSIMD, typename TgFloatPtr>
LATHE_FN float threadgroup_sum(float v, TgFloatPtr scratch, uint simd_id, uint lane) {
  v = simd_sum(v);
  if (NSIMD == 1) return v;
  if (lane == 0) scratch[simd_id] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < NSIMD; ++s) total += scratch[s];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

// ---- RoPE ----------------------------------------------------------------------------------------
// Pair i (0 <= i < D/2) of a head of D elements: standard (interleaved) pairs are (2i, 2i+1),
// NeoX (split-half) pairs are (i, i + D/2). Pair i turns by angle pos * freq_scale * inv_freq(i).
template <int D, bool NEOX>
LATHE_FN uint rope_first(uint i) {
  return NEOX ? i : 2 * i;
}
template <int D, bool NEOX>
LATHE_FN uint rope_second(uint i) {
  return NEOX ? i + D / 2 : 2 * i + 1;
}

// Inverse frequency theta^(-2i/D), read from a precomputed table (which also carries scaled
// frequencies such as Llama 3's) or computed inline.
template <int D, bool FREQ_TABLE, typename FloatPtr>
LATHE_FN float rope_inv_freq(FloatPtr table, uint i, float theta) {
  if (FREQ_TABLE) return table[i];
  return pow(theta, -float(2 * i) / float(D));
}

// Rotate pair i of one head from src to dst (fp16 in and out, fp32 math); gain0/gain1 scale the
// two inputs first (1 for plain RoPE, the RMSNorm factor times the weight for the fused norm).
template <int D, bool NEOX, typename SrcPtr, typename DstPtr>
LATHE_FN void rope_pair(SrcPtr src, DstPtr dst, uint i, float c, float s, float gain0 = 1.0f,
                        float gain1 = 1.0f) {
  const uint a = rope_first<D, NEOX>(i), b = rope_second<D, NEOX>(i);
  const float x0 = float(src[a]) * gain0, x1 = float(src[b]) * gain1;
  dst[a] = half(x0 * c - x1 * s);
  dst[b] = half(x0 * s + x1 * c);
}
