// Greedy sampling on the device: the index of the largest value of each row of logits[M, V]
// (T: float or half, the output head's own type, so no converted copy is made first; the first
// index among equals, as numpy's argmax), written as int32 so that the next step's embedding
// reads it without a host round trip. NaN rows are not special-cased.
// One threadgroup a row (a whole vocabulary is a few hundred KB: one threadgroup of 1024 threads
// streams it in a few microseconds, no second pass). WIDE (each row starts 16-byte aligned:
// V * sizeof(T) a multiple of 16): 16-byte loads, U of them in flight per thread before any is
// compared; otherwise one value per load.
// LATHE_HOST_WORDS > 0 (kernels.loop.argmax's host_words): the tokens also go to the host in
// 8-byte outputs host0 .. host{LATHE_HOST_WORDS - 1}, two rows each (LATHE_HOST_WRITE, made by
// the host: MSL cannot index separate buffers). MLX takes buffers of at most 8 bytes from a small
// pool of managed memory that the GPU maps, so the host reads them where they are, and the GPU's
// writes need no page of it back; `token`, which the next step's embedding reads, is never read
// by the host and stays device memory (kernels/loop/NOTES.md: a buffer the host touched, reused by
// a kernel's output, cost that kernel a page migration of 30-600 us).
// Constants: T, NSIMD, WIDE, U. Inputs: logits, dims (int32: M, V). Output: token (and the host
// words).
#ifndef LATHE_HOST_WORDS
#define LATHE_HOST_WORDS 0
#endif
constexpr uint NT = NSIMD * 32;
constexpr uint PER = 16 / sizeof(T);  // values in a 16-byte word (8 half, 4 float)
threadgroup float best_v[NSIMD];
threadgroup uint best_i[NSIMD];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint simd = simdgroup_index_in_threadgroup;
const uint v = uint(dims[1]);
const auto src = logits + row * v;
float bv = -as_type<float>(0x7f800000u);
uint bi = 0xffffffffu;
// A thread's indices only rise (words tid, tid + NT, ... and the values inside a word in order),
// so keeping the first strictly larger value keeps the first of equals.
const uint words = WIDE ? v / PER : 0;
for (uint w0 = tid; w0 < words; w0 += NT * U) {
  uint4 got[U];
  LATHE_UNROLL
  for (uint u = 0; u < U; ++u) {
    const uint w = w0 + u * NT;
    got[u] = w < words ? load_wide<uint4>(src, w) : uint4{0u, 0u, 0u, 0u};
  }
  LATHE_UNROLL
  for (uint u = 0; u < U; ++u) {
    const uint w = w0 + u * NT;
    if (w >= words) break;
    const uint part[4] = {got[u].x, got[u].y, got[u].z, got[u].w};
    LATHE_UNROLL
    for (uint e = 0; e < PER; ++e) {
      float a;
      if (PER == 8) {
        const half2 pair = as_type<half2>(part[e / 2]);
        a = float(e % 2 == 0 ? pair.x : pair.y);
      } else {
        a = as_type<float>(part[e]);
      }
      if (a > bv) {
        bv = a;
        bi = w * PER + e;
      }
    }
  }
}
for (uint i = words * PER + tid; i < v; i += NT) {
  const float a = float(src[i]);
  if (a > bv) {
    bv = a;
    bi = i;
  }
}
for (ushort off = 16; off > 0; off >>= 1) {
  const float ov = simd_shuffle_xor(bv, off);
  const uint oi = simd_shuffle_xor(bi, off);
  if (ov > bv || (ov == bv && oi < bi)) {
    bv = ov;
    bi = oi;
  }
}
if (lane == 0) {
  best_v[simd] = bv;
  best_i[simd] = bi;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  for (uint s = 1; s < NSIMD; ++s) {
    if (best_v[s] > bv || (best_v[s] == bv && best_i[s] < bi)) {
      bv = best_v[s];
      bi = best_i[s];
    }
  }
  token[row] = int(bi);
#if LATHE_HOST_WORDS
  LATHE_HOST_WRITE(row, int(bi))
#endif
}
