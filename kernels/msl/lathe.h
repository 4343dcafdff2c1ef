// lathe.h: helpers shared by lathe's MSL bodies, written in the portable MSL subset.
// On CUDA it follows cuda_compat.h; on Metal it is the whole header.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;
#define LATHE_FN inline
#define LATHE_UNROLL _Pragma("clang loop unroll(full)")

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
template <typename W, typename T>
LATHE_FN W load_wide(const threadgroup T* p, uint i) {
  return ((const threadgroup W*)p)[i];
}
// MLX binds an input of fewer than 8 elements in the constant address space (kernels/msl/NOTES.md)
template <typename W, typename T>
LATHE_FN W load_wide(const constant T* p, uint i) {
  return ((const constant W*)p)[i];
}
template <typename W, typename T>
LATHE_FN void store_wide(threadgroup T* p, uint i, W w) {
  ((threadgroup W*)p)[i] = w;
}
// load_stream: load_wide for data read once (a GEMM's weights), which on CUDA is marked evict-first
// (ld.global.cs) so that it does not push out of L1 what the other loads use again; on Metal a
// plain load.
template <typename W, typename T>
LATHE_FN W load_stream(const device T* p, uint i) {
  return ((const device W*)p)[i];
}
// threadgroup_view<W>(p): a threadgroup array seen as elements of another type.
template <typename W, typename T>
LATHE_FN threadgroup W* threadgroup_view(threadgroup T* p) {
  return (threadgroup W*)p;
}
// Correctly rounded float arithmetic, never fused or approximated (cuda_compat.h's twins use
// CUDA's _rn intrinsics; the quantizers reproduce GGML's float32 rounding with them).
LATHE_FN float mul_rn(float a, float b) { return precise::fma(a, b, 0.0f); }
LATHE_FN float add_rn(float a, float b) { return precise::fma(a, 1.0f, b); }
LATHE_FN float div_rn(float a, float b) { return precise::divide(a, b); }
// div_rn for normal operands whose quotient is normal: the same quotient (cuda_compat.h's twin
// leaves out the branch CUDA's division takes near the float range's edges).
LATHE_FN float div_rn_normal(float a, float b) { return precise::divide(a, b); }
// dot2_lo / dot2_hi: c + the two int16 halves of a times the int8 bytes 0, 1 (lo) or 2, 3 (hi)
// of b, exactly (CUDA's dp2a).
LATHE_FN int dot2_lo(uint a, uint b, int c) {
  return c + int(short(a & 0xffffu)) * int(char(b & 0xffu)) +
         int(short(a >> 16)) * int(char((b >> 8) & 0xffu));
}
LATHE_FN int dot2_hi(uint a, uint b, int c) { return dot2_lo(a, b >> 16, c); }
// byte_perm(x, y, s): byte n of the result is byte (s >> 4n) & 7 of the eight bytes y:x (CUDA's
// __byte_perm, one prmt instruction there).
LATHE_FN uint byte_perm(uint x, uint y, uint s) {
  uint r = 0u;
  for (uint n = 0; n < 4; ++n) {
    const uint i = (s >> (4 * n)) & 7u;
    r |= (((i < 4u ? x : y) >> (8 * (i & 3u))) & 255u) << (8 * n);
  }
  return r;
}
// async_copy_wide / async_copy_wide_l1 / async_copy_word / async_commit / async_wait<N>: cuda_compat.h's copies into
// threadgroup memory that bypass registers; here a plain 16-byte copy, complete when the call returns.
template <typename T>
LATHE_FN void async_copy_wide(threadgroup uint4* dst, const device T* src, uint i) {
  *dst = ((const device uint4*)src)[i];
}
template <typename T>
LATHE_FN void async_copy_wide_l1(threadgroup uint4* dst, const device T* src, uint i) {
  *dst = ((const device uint4*)src)[i];
}
// async_copy_word: one 4-byte word (element i of src viewed as uint) the same way.
template <typename T>
LATHE_FN void async_copy_word(threadgroup uint* dst, const device T* src, uint i) {
  *dst = ((const device uint*)src)[i];
}
LATHE_FN void async_commit() {}
template <int N>
LATHE_FN void async_wait() {}
// prefetch_l2: cuda_compat.h's hint that bytes of p will be read soon; Metal has no prefetch.
template <typename T>
LATHE_FN void prefetch_l2(const device T* p, size_t begin, size_t bytes, uint lane, uint lanes) {}
// timeline_stamp: cuda_compat.h's three words of "now"; MSL has no global timer that a kernel
// reads, so kernels.blocks refuses a timeline on Metal and this twin writes zeros.
LATHE_FN void timeline_stamp(device uint* at) {
  at[0] = 0u;
  at[1] = 0u;
  at[2] = 0u;
}
// grid_ticket / grid_signal / grid_wait / grid_reset: counters shared by the threadgroups of a
// launch (cuda_compat.h has the CUDA twins and their contract). Device-scope fences need MSL 3.2
// (atomic_thread_fence with thread_scope_device). Not run on Metal: this project has no Apple GPU.
LATHE_FN device atomic_uint* lathe_counter(const device uint* counter) {
  return (device atomic_uint*)const_cast<device uint*>(counter);
}
LATHE_FN void lathe_device_fence() {
  atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
}
LATHE_FN uint grid_ticket(const device uint* counter) {
  return atomic_fetch_add_explicit(lathe_counter(counter), 1u, memory_order_relaxed);
}
LATHE_FN uint grid_signal(const device uint* counter) {
  lathe_device_fence();  // MSL's atomics are relaxed only: a fence stands for the release
  return atomic_fetch_add_explicit(lathe_counter(counter), 1u, memory_order_relaxed);
}
LATHE_FN void grid_wait(const device uint* counter, uint target) {
  while (atomic_load_explicit(lathe_counter(counter), memory_order_relaxed) < target) {
  }
  lathe_device_fence();  // ... and for the acquire
}
LATHE_FN void grid_reset(const device uint* counter, uint count) {
  lathe_device_fence();
  for (uint i = 0; i < count; ++i) atomic_store_explicit(lathe_counter(counter + i), 0u, memory_order_relaxed);
}
// The layout of a simdgroup_matrix<T, 8, 8>'s thread_elements() (Apple's, as MLX's steel GEMMs
// use it; cuda_compat.h's twins give the CUDA layout): lane l holds row sg8x8_row(l), columns
// sg8x8_col(l) and sg8x8_col(l) + 1; the four lanes of a row are l, l^1, l^8, l^9.
LATHE_FN uint sg8x8_row(uint lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
LATHE_FN uint sg8x8_col(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }
// Paired products of 8x8 matrices (cuda_compat.h: one m16n8k16 each, which Metal's 8x8 API
// cannot express): d += a0 b0 + a1 b1, and for two row blocks d0 += a00 b0 + a01 b1,
// d1 += a10 b0 + a11 b1.
LATHE_FN void sg8x8_mma_k16(thread simdgroup_float8x8& d, thread const simdgroup_half8x8& a0,
                            thread const simdgroup_half8x8& a1, thread const simdgroup_half8x8& b0,
                            thread const simdgroup_half8x8& b1) {
  simdgroup_multiply_accumulate(d, a0, b0, d);
  simdgroup_multiply_accumulate(d, a1, b1, d);
}
LATHE_FN void sg8x8_mma_k16x2(thread simdgroup_float8x8& d0, thread simdgroup_float8x8& d1,
                              thread const simdgroup_half8x8& a00, thread const simdgroup_half8x8& a01,
                              thread const simdgroup_half8x8& a10, thread const simdgroup_half8x8& a11,
                              thread const simdgroup_half8x8& b0, thread const simdgroup_half8x8& b1) {
  sg8x8_mma_k16(d0, a00, a01, b0, b1);
  sg8x8_mma_k16(d1, a10, a11, b0, b1);
}
// The lane whose elements are row `row`, columns `col` (even) and col + 1: sg8x8_row/col inverted.
LATHE_FN uint sg8x8_lane(uint row, uint col) {
  return ((row & 4) << 2) | ((col & 4) << 1) | ((row & 3) << 1) | ((col >> 1) & 1);
}
// A half matrix given by column pairs (cuda_compat.h: the B layout as it is): lane l's word holds
// rows sg8x8_col(l) and sg8x8_col(l) + 1 of column sg8x8_row(l). Each lane gathers its row's two
// elements from the lanes that hold columns c and c + 1.
LATHE_FN simdgroup_half8x8 sg8x8_from_col_pairs(half2 w, uint lane) {
  const uint r = sg8x8_row(lane), c = sg8x8_col(lane);
  const half2 a = simd_shuffle(w, ushort(sg8x8_lane(c, r & 6u)));
  const half2 b = simd_shuffle(w, ushort(sg8x8_lane(c + 1, r & 6u)));
  simdgroup_half8x8 m;
  m.thread_elements() = (r & 1) ? half2(a.y, b.y) : half2(a.x, b.x);
  return m;
}
LATHE_FN float sg8x8_row_sum(float v) {
  v += simd_shuffle_xor(v, ushort(1));
  return v + simd_shuffle_xor(v, ushort(8));
}
LATHE_FN float sg8x8_row_max(float v) {
  v = max(v, simd_shuffle_xor(v, ushort(1)));
  return max(v, simd_shuffle_xor(v, ushort(8)));
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

// ---- a post-block norm (Gemma's) -----------------------------------------------------------------
// y[i] = stream[i] + RMSNorm(blk)[i] * gamma[i] for i < d, in float32 (blk, gamma fp16), or
// stream[i] where !add: into the threadgroup row y, and into out as well where `write`. All threads
// of the threadgroup call it; y is whole once it returns (its trailing barrier).
template <uint NSIMD, typename Tg, typename Out, typename Stream, typename Blk, typename Gamma, typename TgFloatPtr>
LATHE_FN void post_norm_add(Tg y, Out out, bool write, Stream stream, Blk blk, Gamma gamma, bool add, float eps,
                            uint d, uint tid, TgFloatPtr scratch, uint simd_id, uint lane) {
  float ss = 0.0f;
  for (uint i = tid; add && i < d; i += NSIMD * 32) {
    const float b = float(blk[i]);
    ss += b * b;
  }
  const float inv = rsqrt(threadgroup_sum<NSIMD>(ss, scratch, simd_id, lane) / float(d) + eps);
  for (uint i = tid; i < d; i += NSIMD * 32) {
    const float v = add ? float(stream[i]) + float(blk[i]) * inv * float(gamma[i]) : float(stream[i]);
    y[i] = v;
    if (write) out[i] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// ---- the FFN's gate activation -------------------------------------------------------------------
// ACT 0: SiLU, x / (1 + e^-x); 1: GELU in its tanh approximation (ggml_gelu, Gemma's
// gelu_pytorch_tanh), 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). Kernels that apply it
// take LATHE_ACT from their prelude (kernels.gemv's and kernels.loop's specs; 0 where unset).
template <uint ACT>
LATHE_FN float gate_act(float x) {
  if (ACT == 1) return 0.5f * x * (1.0f + tanh(0.7978845608028654f * fma(0.044715f * x, x * x, x)));
  return x / (1.0f + exp(-x));
}

// ---- X' codes ------------------------------------------------------------------------------------
// rint(v * inv) for |v * inv| < 2^22, where inv is 32767 over a block's largest magnitude (X''s
// int16 codes: gemv/x_stage.metal, y_codes.metal, decode_rows' out codes), by the float adder:
// v * inv plus 1.5 * 2^23 rounds to the nearest integer, ties to even (as rint), into the low bits
// of the word, so code_bits(v, inv) - code_bias() is the code and its low 16 bits are the code's
// int16. The product and the sum are rounded apart (mul_rn, add_rn: no fused multiply-add), so the
// codes are rint's bit for bit; rint took F2I, a conversion an SM issues at an eighth of the rate
// of an add (the 8B token's down ticket stages 14336 values of X').
LATHE_FN constexpr uint code_bias() { return 0x4B400000u; }  // the bits of 1.5 * 2^23
LATHE_FN uint code_bits(float v, float inv) { return as_type<uint>(add_rn(mul_rn(v, inv), 12582912.0f)); }
LATHE_FN int code_of(float v, float inv) { return int(code_bits(v, inv) - code_bias()); }
// A block's inv (32767 over its largest magnitude m; 0 for a block of zeros) and its scale (m over
// 32767), each the correctly rounded quotient: m is an fp16 magnitude or a normal float32 one, for
// which div_rn_normal is the division without its slow path (on CUDA a subroutine call whose fixed
// registers made ptxas spill the token block's scalars: kernels/loop/NOTES.md).
LATHE_FN float code_inv(float m) { return m > 0.0f ? div_rn_normal(32767.0f, m) : 0.0f; }
LATHE_FN float code_scale(float m) { return div_rn_normal(m, 32767.0f); }

// ---- the IQ4 blocks' levels ----------------------------------------------------------------------
// The eight nibbles of q -> their levels of GGML's kvalues_iq4nl as int8 bytes (the dot products'
// weights): .x those of the low nibbles of bytes 0..3, .y those of the high ones (reference/
// iquant.py's KVALUES). The 16 levels are four words; byte_perm looks four nibbles up at once in
// levels 0-7 and in 8-15 (a selector uses a nibble's low 3 bits), keeps each byte from the half its
// top bit names, then gathers the low and the high nibbles' bytes: 8 byte_perms for 8 levels.
LATHE_FN uint2 iq4_levels(uint q) {
  const uint half_of = 0x32103210u | ((q & 0x88888888u) >> 1);  // nibble k: k % 4, + 4 from levels 8-15
  uint by_nibble[2];  // levels of nibbles 0-3, then 4-7
  for (uint i = 0; i < 2; ++i) {
    const uint low8 = byte_perm(0xBFAD9881u, 0xF6EADDCFu, q >> (16 * i));
    const uint high8 = byte_perm(0x26190D01u, 0x71594535u, q >> (16 * i));
    by_nibble[i] = byte_perm(low8, high8, half_of >> (16 * i));
  }
  return uint2{byte_perm(by_nibble[0], by_nibble[1], 0x6420u), byte_perm(by_nibble[0], by_nibble[1], 0x7531u)};
}

// ---- K-quant super-blocks --------------------------------------------------------------------------
// Bytes of a GGUF super-block of 256 weights by the bodies' block type code (2 Q4_K, 3 Q5_K, 4 Q6_K;
// reference/kquant.py has the layouts), for the kernels that read GGUF's own blocks.
template <uint QTYPE>
LATHE_FN constexpr uint kquant_super_bytes() {
  return QTYPE == 2 ? 144 : QTYPE == 3 ? 176 : 210;
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

// Two neighbouring pairs 2j and 2j+1 of one head, as (a0, b0) and (a1, b1): the unit of work of
// the bandwidth-bound RoPE kernels. Standard pairs are elements 4j .. 4j+3, moved as one 8-byte
// word; NeoX pairs are elements 2j, 2j+1 and D/2 + 2j, D/2 + 2j+1, moved as two 4-byte words.
// Loads keep the raw halves in a half4 (fewer registers while many loads are in flight; on
// CUDA, cuda_compat.h's half4 spells the .xy/.zw swizzles as members); the math is fp32.
struct Pairs2 {
  float a0, b0, a1, b1;
};

template <int D, bool NEOX, typename SrcPtr>
LATHE_FN half4 load_pairs2(SrcPtr src, uint j) {
  if (NEOX) {
    half4 w;
    w.xy = load_wide<half2>(src, j);
    w.zw = load_wide<half2>(src + D / 2, j);
    return w;
  }
  return load_wide<half4>(src, j);
}

template <bool NEOX>
LATHE_FN Pairs2 unpack_pairs2(half4 w) {
  Pairs2 p;
  if (NEOX) {  // xy = (a0, a1), zw = (b0, b1)
    p.a0 = float(w.xy.x); p.a1 = float(w.xy.y); p.b0 = float(w.zw.x); p.b1 = float(w.zw.y);
  } else {  // xy = (a0, b0), zw = (a1, b1)
    p.a0 = float(w.xy.x); p.b0 = float(w.xy.y); p.a1 = float(w.zw.x); p.b1 = float(w.zw.y);
  }
  return p;
}

template <int D, bool NEOX, typename DstPtr>
LATHE_FN void store_half4(DstPtr dst, uint j, half4 w) {
  if (NEOX) {
    store_wide<half2>(dst, j, w.xy);
    store_wide<half2>(dst + D / 2, j, w.zw);
  } else {
    store_wide<half4>(dst, j, w);
  }
}

template <bool NEOX>
LATHE_FN half4 pack_pairs2(Pairs2 p) {
  half4 w;
  if (NEOX) {
    w.xy = half2(half(p.a0), half(p.a1));
    w.zw = half2(half(p.b0), half(p.b1));
  } else {
    w.xy = half2(half(p.a0), half(p.b0));
    w.zw = half2(half(p.a1), half(p.b1));
  }
  return w;
}

template <int D, bool NEOX, typename DstPtr>
LATHE_FN void store_pairs2(DstPtr dst, uint j, Pairs2 p) {
  store_half4<D, NEOX>(dst, j, pack_pairs2<NEOX>(p));
}

// Element e of kv head h's row at `slot` (block slot / BS, row slot % BS) in vLLM's paged caches:
// K [blocks, Hkv, D/8, BS, 8], V [blocks, Hkv, D, BS].
template <int D, uint BS>
LATHE_FN uint paged_k_at(uint slot, uint h, uint n_kv, uint e) {
  return ((((slot / BS) * n_kv + h) * uint(D / 8) + e / 8) * BS + slot % BS) * 8 + e % 8;
}
template <int D, uint BS>
LATHE_FN uint paged_v_at(uint slot, uint h, uint n_kv, uint e) {
  return (((slot / BS) * n_kv + h) * uint(D) + e) * BS + slot % BS;
}

// A thread's half4 of one head row (load_pairs2's elements: xy at e0, zw at e1, each a pair of
// neighbours) into the paged caches at `slot` of kv head h (in K a pair stays within its 8).
template <int D, bool NEOX, uint BS, typename DstPtr>
LATHE_FN void store_half4_paged_k(DstPtr k, uint slot, uint h, uint n_kv, uint j, half4 w) {
  const uint e0 = NEOX ? 2 * j : 4 * j, e1 = NEOX ? D / 2 + 2 * j : 4 * j + 2;
  store_wide<half2>(k, paged_k_at<D, BS>(slot, h, n_kv, e0) / 2, w.xy);
  store_wide<half2>(k, paged_k_at<D, BS>(slot, h, n_kv, e1) / 2, w.zw);
}

template <int D, bool NEOX, uint BS, typename DstPtr>
LATHE_FN void store_half4_paged_v(DstPtr v, uint slot, uint h, uint n_kv, uint j, half4 w) {
  const uint e0 = NEOX ? 2 * j : 4 * j, e1 = NEOX ? D / 2 + 2 * j : 4 * j + 2;
  v[paged_v_at<D, BS>(slot, h, n_kv, e0)] = w.xy.x;
  v[paged_v_at<D, BS>(slot, h, n_kv, e0 + 1)] = w.xy.y;
  v[paged_v_at<D, BS>(slot, h, n_kv, e1)] = w.zw.x;
  v[paged_v_at<D, BS>(slot, h, n_kv, e1 + 1)] = w.zw.y;
}

// Turn both pairs: pair 2j by (c0, s0), pair 2j+1 by (c1, s1).
LATHE_FN Pairs2 rotate_pairs2(Pairs2 x, float c0, float s0, float c1, float s1) {
  Pairs2 r;
  r.a0 = x.a0 * c0 - x.b0 * s0;
  r.b0 = x.a0 * s0 + x.b0 * c0;
  r.a1 = x.a1 * c1 - x.b1 * s1;
  r.b1 = x.a1 * s1 + x.b1 * c1;
  return r;
}
