// cuda_compat.h: the portable MSL subset of DESIGN.md, spelled in CUDA.
//
// mx.fast.cuda_kernel pastes this header after MLX's own includes (cuda_fp16.h among them) and
// before the generated __global__ function, whose body is our MSL body unchanged. It maps names
// and nothing more. In particular it defines no math: CUDA already has float overloads of exp,
// rsqrt, cos, sin, pow, fma, max and min, and redefining them makes calls ambiguous.
// Every mapping here is exercised by tests/test_compat_gpu.py.
#pragma once

// ---- scalar types: half and half2 come from cuda_fp16.h (typedefs of __half, __half2) -------
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;  // 64 bits, as Metal's (Linux LP64)

// ---- address spaces -----------------------------------------------------------------------------
// Only `threadgroup`, and only on declarations (`threadgroup float buf[N];`). `device` and
// `constant` cannot be macros here: CUDA spells __device__ and __constant__ through those very
// tokens (__location__(device)), so an empty `device` would silently strip __device__ from every
// later function. Bodies therefore declare local pointers with `auto`, and the few casts that
// need an address space go through the helpers below (lathe.h has their Metal twins).
#define threadgroup __shared__

// Helpers in lathe.h are device functions here and plain inline functions on Metal.
#define LATHE_FN __device__ __forceinline__

// ---- vectors and pointers ------------------------------------------------------------------------
// half4: Metal's 4-half vector, as a struct whose members spell its .xy and .zw swizzles.
struct alignas(8) half4 {
  half2 xy, zw;
};

// writable: the in-place cache view (lathe.h has the Metal twin, with address spaces).
template <typename T>
__device__ __forceinline__ T* writable(const T* p) {
  return const_cast<T*>(p);
}

// load_wide / store_wide: element i of p viewed as an array of W (uint4: 16-byte accesses).
// half4 moves as one 8-byte word: a plain struct copy would move its two halves one by one.
template <typename W>
struct lathe_wide {
  template <typename T>
  static __device__ __forceinline__ W load(const T* p, uint i) {
    return reinterpret_cast<const W*>(p)[i];
  }
  template <typename T>
  static __device__ __forceinline__ void store(T* p, uint i, W w) {
    reinterpret_cast<W*>(p)[i] = w;
  }
};
template <>
struct lathe_wide<half4> {
  template <typename T>
  static __device__ __forceinline__ half4 load(const T* p, uint i) {
    const uint2 word = reinterpret_cast<const uint2*>(p)[i];
    return *reinterpret_cast<const half4*>(&word);
  }
  template <typename T>
  static __device__ __forceinline__ void store(T* p, uint i, half4 w) {
    reinterpret_cast<uint2*>(p)[i] = *reinterpret_cast<const uint2*>(&w);
  }
};
template <typename W, typename T>
__device__ __forceinline__ W load_wide(const T* p, uint i) {
  return lathe_wide<W>::load(p, i);
}
template <typename W, typename T>
__device__ __forceinline__ void store_wide(T* p, uint i, W w) {
  lathe_wide<W>::store(p, i, w);
}
// load_stream: load_wide for data read once (a GEMM's weights), evict-first in L1 and L2
// (ld.global.cs), so that the lines other loads reuse stay (lathe.h: a plain load on Metal).
template <typename W, typename T>
__device__ __forceinline__ W load_stream(const T* p, uint i) {
  return __ldcs(reinterpret_cast<const W*>(p) + i);
}

// threadgroup_view<W>(p): a threadgroup array seen as elements of another type (Metal needs the
// address space in the cast; lathe.h has that twin).
template <typename W, typename T>
__device__ __forceinline__ W* threadgroup_view(T* p) {
  return reinterpret_cast<W*>(p);
}

// as_type<T>(v): Metal's bit cast, for the types the bodies use.
template <typename T, typename U>
__device__ __forceinline__ T as_type(U v);
template <>
__device__ __forceinline__ float as_type<float, uint>(uint v) {
  return __uint_as_float(v);
}
template <>
__device__ __forceinline__ uint as_type<uint, float>(float v) {
  return __float_as_uint(v);
}
template <>
__device__ __forceinline__ half as_type<half, ushort>(ushort v) {
  return __ushort_as_half(v);
}
template <>
__device__ __forceinline__ ushort as_type<ushort, half>(half v) {
  return __half_as_ushort(v);
}
template <>
__device__ __forceinline__ half2 as_type<half2, uint>(uint v) {
  return *reinterpret_cast<const half2*>(&v);
}
template <>
__device__ __forceinline__ uint as_type<uint, half2>(half2 v) {
  return *reinterpret_cast<const uint*>(&v);
}

// Correctly rounded float arithmetic that the compiler may not fuse into an fma or approximate
// (quantizers must reproduce GGML's float32 rounding bit for bit).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
// a / b for normal operands with a normal quotient, rounded to nearest: CUDA's division without its
// check (FCHK) and the slow-path call it guards, whose result it equals wherever the check passes:
// the reciprocal's estimate refined once, the quotient corrected once by the remainder (Markstein).
__device__ __forceinline__ float div_rn_normal(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  r = __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r);
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(-b, q, a), r, q);
}

// dot2_lo / dot2_hi: c + the two int16 halves of a times the int8 bytes 0, 1 (lo) or 2, 3 (hi) of
// b, exactly (one dp2a instruction on NVIDIA; lathe.h spells it out for Metal).
__device__ __forceinline__ int dot2_lo(uint a, uint b, int c) { return __dp2a_lo(int(a), int(b), c); }
__device__ __forceinline__ int dot2_hi(uint a, uint b, int c) { return __dp2a_hi(int(a), int(b), c); }
// byte_perm(x, y, s): byte n of the result is byte (s >> 4n) & 7 of the eight bytes y:x (one prmt).
__device__ __forceinline__ uint byte_perm(uint x, uint y, uint s) { return __byte_perm(x, y, s); }

// async_copy_wide(dst, src, i): element i of src viewed as uint4 (16 bytes) into *dst in
// threadgroup memory, without passing through registers (cp.async: the thread goes on while the
// bytes travel). async_commit() closes this thread's group of copies; async_wait<N>() returns
// once at most N of its groups are still in flight. Each thread waits for its own copies only:
// a barrier then makes them visible to the others. (lathe.h: on Metal, a plain copy.)
template <typename T>
__device__ __forceinline__ void async_copy_wide(uint4* dst, const T* src, uint i) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to),
               "l"(reinterpret_cast<const uint4*>(src) + i));
}
// async_copy_wide_l1: the same through the L1 (cp.async.ca), where a thread's neighbouring copies
// share 32-byte sectors that its warp's other copies do not (one row a lane): the L1 then asks the
// L2 for a sector once, where cp.async.cg asks for each 16-byte half.
template <typename T>
__device__ __forceinline__ void async_copy_wide_l1(uint4* dst, const T* src, uint i) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(to),
               "l"(reinterpret_cast<const uint4*>(src) + i));
}
// async_copy_word: one 4-byte word (element i of src viewed as uint) into *dst the same way
// (cp.async.ca: 4-byte copies go through the L1).
template <typename T>
__device__ __forceinline__ void async_copy_word(uint* dst, const T* src, uint i) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(to),
               "l"(reinterpret_cast<const uint*>(src) + i));
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- SIMD-group matrices: Metal's simdgroup_matrix<T, 8, 8> on the tensor cores -----------------
// A warp's 8x8 matrix, two elements a lane, in one of two layouts that a matrix records (`cols`):
//  rows (the mma's A and C/D operands): lane l holds row l/4, columns 2(l%4) and 2(l%4)+1;
//  cols (the mma's B operand): lane l holds rows 2(l%4) and 2(l%4)+1 of column l/4.
// A plain load reads a row pair into the rows layout; a transposed load reads the very same
// words and marks the matrix `cols` (element (r, c) of a transposed matrix is memory (c, r)), so
// K loaded transposed for Q.K^T reaches the mma without a shuffle. A matrix used in the other
// layout is converted first (movmatrix for half, four shuffles for float). After inlining `cols`
// is a constant and the branches fold away. The multiply is mma.sync m16n8k8 with rows 8-15 of
// A zero: NVIDIA has no 8-row f16 MMA, so half of each tensor-core op is spent on nothing.
// Half operands only (float A or B would need tf32, which the bodies do not use). lathe.h has
// the layout helpers (sg8x8_row/col, sg8x8_row_sum/max) that thread_elements() needs on both
// backends.
template <typename T>
struct lathe_pair;
template <>
struct lathe_pair<float> {
  typedef float2 type;
};
template <>
struct lathe_pair<half> {
  typedef half2 type;
};
template <typename T, int Cols, int Rows>
struct simdgroup_matrix;
template <typename T>
__device__ __forceinline__ void lathe_sg_to(const simdgroup_matrix<T, 8, 8>& m, bool cols);
template <typename T>
struct simdgroup_matrix<T, 8, 8> {
  mutable typename lathe_pair<T>::type e;
  mutable bool cols = false;
  // Metal's thread_elements(): this lane's two elements, row sg8x8_row(lane), columns
  // sg8x8_col(lane) and sg8x8_col(lane) + 1 (the rows layout).
  __device__ __forceinline__ typename lathe_pair<T>::type& thread_elements() {
    lathe_sg_to(*this, false);
    return e;
  }
};
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;

// The calling thread's lane (Metal's thread_index_in_simdgroup) whatever the threadgroup's shape.
__device__ __forceinline__ uint lathe_lane() {
  uint lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}
__device__ __forceinline__ uint lathe_movmatrix_trans(uint w) {
  uint out;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(out) : "r"(w));
  return out;
}
// rows <-> cols of one matrix: the element a lane wants in one layout sits, in the other, at lane
// 4 * (its column) + (its row) / 2, slot (its row) % 2; the same formula both ways.
__device__ __forceinline__ float2 lathe_sg_swap_float(float2 v) {
  const uint lane = lathe_lane(), g = lane >> 2, t = lane & 3u;
  const uint from0 = 8u * t + (g >> 1), from1 = from0 + 4u;
  const float x0 = __shfl_sync(0xffffffffu, v.x, from0), y0 = __shfl_sync(0xffffffffu, v.y, from0);
  const float x1 = __shfl_sync(0xffffffffu, v.x, from1), y1 = __shfl_sync(0xffffffffu, v.y, from1);
  return (g & 1u) ? make_float2(y0, y1) : make_float2(x0, x1);
}
template <>
__device__ __forceinline__ void lathe_sg_to<half>(const simdgroup_matrix<half, 8, 8>& m, bool cols) {
  if (m.cols != cols) {
    m.e = as_type<half2>(lathe_movmatrix_trans(as_type<uint>(m.e)));
    m.cols = cols;
  }
}
template <>
__device__ __forceinline__ void lathe_sg_to<float>(const simdgroup_matrix<float, 8, 8>& m, bool cols) {
  if (m.cols != cols) {
    m.e = lathe_sg_swap_float(m.e);
    m.cols = cols;
  }
}

// An operand's word in the layout the mma wants, taken at once: the same matrix may be passed
// as two operands that want different layouts (a * a), and the next conversion is in place.
__device__ __forceinline__ uint lathe_sg_word(const simdgroup_half8x8& m, bool cols) {
  lathe_sg_to(m, cols);
  return as_type<uint>(m.e);
}
__device__ __forceinline__ float2 lathe_sg_rows(const simdgroup_float8x8& m) {
  lathe_sg_to(m, false);
  return m.e;
}

template <typename T, int Cols, int Rows>
__device__ __forceinline__ simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e.x = value;
  m.e.y = value;
  return m;
}

// matrix_origin is (column, row) in the source; a scalar origin means (o, o), as in Metal.
__device__ __forceinline__ ulong2 lathe_origin(ulong2 o) { return o; }
__device__ __forceinline__ ulong2 lathe_origin(ulong o) { return make_ulong2(o, o); }
template <typename T>
__device__ __forceinline__ const T* lathe_sg_pair(const T* base, ulong stride, ulong2 o) {
  const uint lane = lathe_lane();
  return base + (o.y + (lane >> 2)) * stride + o.x + 2u * (lane & 3u);
}
template <typename T, typename O = ulong>
__device__ __forceinline__ void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const T* src,
                                               ulong elements_per_row = 8, O matrix_origin = 0,
                                               bool transpose_matrix = false) {
  const T* p = lathe_sg_pair(src, elements_per_row, lathe_origin(matrix_origin));
  typedef typename lathe_pair<T>::type P;
  if ((reinterpret_cast<size_t>(p) & (sizeof(P) - 1)) == 0) {
    d.e = *reinterpret_cast<const P*>(p);
  } else {
    d.e.x = p[0];
    d.e.y = p[1];
  }
  d.cols = transpose_matrix;
}
template <typename T, typename O = ulong>
__device__ __forceinline__ void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, T* dst,
                                                ulong elements_per_row = 8, O matrix_origin = 0,
                                                bool transpose_matrix = false) {
  lathe_sg_to(a, transpose_matrix);  // a transposed store writes the cols layout's pairs
  T* p = const_cast<T*>(lathe_sg_pair<T>(dst, elements_per_row, lathe_origin(matrix_origin)));
  typedef typename lathe_pair<T>::type P;
  if ((reinterpret_cast<size_t>(p) & (sizeof(P) - 1)) == 0) {
    *reinterpret_cast<P*>(p) = a.e;
  } else {
    p[0] = a.e.x;
    p[1] = a.e.y;
  }
}

// d = a * b + c, fp32 or fp16 accumulation (d may be c).
__device__ __forceinline__ void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_half8x8& a,
                                                              const simdgroup_half8x8& b, const simdgroup_float8x8& c) {
  const uint wa = lathe_sg_word(a, false), wb = lathe_sg_word(b, true);
  const float2 wc = lathe_sg_rows(c);
  float d0, d1, d2, d3;
  asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
               : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
               : "r"(wa), "r"(0u), "r"(wb), "f"(wc.x), "f"(wc.y), "f"(0.0f), "f"(0.0f));
  (void)d2, (void)d3;  // rows 8-15: A's zero rows
  d.e = make_float2(d0, d1);
  d.cols = false;
}
__device__ __forceinline__ void simdgroup_multiply_accumulate(simdgroup_half8x8& d, const simdgroup_half8x8& a,
                                                              const simdgroup_half8x8& b, const simdgroup_half8x8& c) {
  const uint wa = lathe_sg_word(a, false), wb = lathe_sg_word(b, true), wc = lathe_sg_word(c, false);
  uint d0, d1;
  asm("mma.sync.aligned.m16n8k8.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3}, {%4}, {%5,%6};"
               : "=r"(d0), "=r"(d1)
               : "r"(wa), "r"(0u), "r"(wb), "r"(wc), "r"(0u));
  (void)d1;
  d.e = as_type<half2>(d0);
  d.cols = false;
}
template <typename T>
__device__ __forceinline__ void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_half8x8& a,
                                                   const simdgroup_half8x8& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, 8, 8>(T(0.0f)));
}
// lathe.h's paired products (Metal: four or two simdgroup_multiply_accumulate): one m16n8k16,
// whose A operand is four of our 8x8 fragments in the rows layout and whose B is two in the cols
// layout, word for word. sg8x8_mma_k16x2: d0 += a00 b0 + a01 b1 and d1 += a10 b0 + a11 b1 (two
// row blocks, two k blocks, no lane idle); sg8x8_mma_k16: d += a0 b0 + a1 b1 (rows 8-15 zero).
__device__ __forceinline__ void lathe_mma_k16(float2& top, float2& bottom, uint a00, uint a10, uint a01,
                                              uint a11, uint b0, uint b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(top.x), "+f"(top.y), "+f"(bottom.x), "+f"(bottom.y)
      : "r"(a00), "r"(a10), "r"(a01), "r"(a11), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void sg8x8_mma_k16x2(simdgroup_float8x8& d0, simdgroup_float8x8& d1,
                                                const simdgroup_half8x8& a00, const simdgroup_half8x8& a01,
                                                const simdgroup_half8x8& a10, const simdgroup_half8x8& a11,
                                                const simdgroup_half8x8& b0, const simdgroup_half8x8& b1) {
  const uint w00 = lathe_sg_word(a00, false), w01 = lathe_sg_word(a01, false);
  const uint w10 = lathe_sg_word(a10, false), w11 = lathe_sg_word(a11, false);
  const uint wb0 = lathe_sg_word(b0, true), wb1 = lathe_sg_word(b1, true);
  lathe_sg_to(d0, false), lathe_sg_to(d1, false);
  lathe_mma_k16(d0.e, d1.e, w00, w10, w01, w11, wb0, wb1);
}
__device__ __forceinline__ void sg8x8_mma_k16(simdgroup_float8x8& d, const simdgroup_half8x8& a0,
                                              const simdgroup_half8x8& a1, const simdgroup_half8x8& b0,
                                              const simdgroup_half8x8& b1) {
  const uint w0 = lathe_sg_word(a0, false), w1 = lathe_sg_word(a1, false);
  const uint wb0 = lathe_sg_word(b0, true), wb1 = lathe_sg_word(b1, true);
  lathe_sg_to(d, false);
  float2 unused = make_float2(0.0f, 0.0f);
  lathe_mma_k16(d.e, unused, w0, 0u, w1, 0u, wb0, wb1);
}
// A half matrix given by column pairs: lane l's word holds rows sg8x8_col(l) and sg8x8_col(l) + 1
// of column sg8x8_row(l), as two keys of one dimension lie in a paged V block: the B operand's
// layout as it is (lathe.h's Metal twin shuffles).
__device__ __forceinline__ simdgroup_half8x8 sg8x8_from_col_pairs(half2 w, uint lane) {
  (void)lane;
  simdgroup_half8x8 m;
  m.e = w;
  m.cols = true;
  return m;
}
// The fragment layout (lathe.h's Metal twins follow Apple's): lane l's elements are row
// sg8x8_row(l), columns sg8x8_col(l) and sg8x8_col(l) + 1; the four lanes of a row differ in
// their two low bits, so a row reduces over shuffles by 1 and 2.
__device__ __forceinline__ uint sg8x8_row(uint lane) { return lane >> 2; }
__device__ __forceinline__ uint sg8x8_col(uint lane) { return 2u * (lane & 3u); }
__device__ __forceinline__ float sg8x8_row_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float sg8x8_row_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// ---- work shared across threadgroups (gemv/seam.metal) -------------------------------------------
// Counters in a uint32 buffer that the kernel takes as an input (MLX passes inputs read-only; the
// same const_cast as `writable`). grid_ticket: claim the next number (relaxed: it orders nothing).
// grid_signal: count one, after this thread's earlier device writes and reads (a release; the
// threadgroup barrier before it hands the other threads' writes to this one, as in CUTLASS's
// generic barrier); returns the count before. grid_wait: spin until a count reaches `target`,
// then see what the signalling threads wrote (an acquire load; a threadgroup barrier after it
// hands that on). grid_reset: zero `count` counters, after everything the signals before it
// ordered (an acquire fence: the last of a set of releasing signals resets). Release and
// acquire, not the sequentially consistent fence of __threadfence() (MEMBAR.SC.GPU in sm_90
// SASS), which a seam paid twice on its path from GEMV A's last rows to GEMV B.
// (lathe.h: the Metal twins.)
__device__ __forceinline__ uint grid_ticket(const uint* counter) {
  return atomicAdd(const_cast<uint*>(counter), 1u);
}
__device__ __forceinline__ uint grid_signal(const uint* counter) {
  uint before;
  asm volatile("atom.release.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
  return before;
}
__device__ __forceinline__ uint lathe_load_acquire(const uint* counter) {
  uint value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}
__device__ __forceinline__ void grid_wait(const uint* counter, uint target) {
  for (uint polls = 0; lathe_load_acquire(counter) < target; ++polls) {
    __nanosleep(64);
    // 2^25 polls (seconds) mean a count that will never come (a bug, not a slow GEMV): fail the
    // launch loudly rather than hang the GPU.
    if (polls == (1u << 25)) __trap();
  }
}
__device__ __forceinline__ void grid_reset(const uint* counter, uint count) {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
  for (uint i = 0; i < count; ++i) atomicExch(const_cast<uint*>(counter) + i, 0u);
}

// timeline_stamp(at): three words of "now" for a launch's own timeline (token_block's stamps,
// harness.tools.block_timeline): %globaltimer's low 32 bits (ns, one clock for every SM, but on
// some GPUs it only moves every microsecond), %clock (this SM's cycles: fine-grained, its own
// origin) and %smid, so that the host can line each SM's cycles up with the shared nanoseconds.
__device__ __forceinline__ void timeline_stamp(uint* at) {
  unsigned long long ns;
  uint cycles, sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  asm volatile("mov.u32 %0, %%clock;" : "=r"(cycles));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  at[0] = uint(ns);
  at[1] = cycles;
  at[2] = sm;
}

// prefetch_l2(p, begin, bytes, lane, lanes): bytes [begin, begin + bytes) of p brought into the
// L2 cache ahead of their loads, one 128-byte line an instruction (prefetch.global.L2: nothing
// waits for it), the `lanes` callers taking lines in turn. A hint; lathe.h's Metal twin does
// nothing (MSL has no prefetch).
template <typename T>
__device__ __forceinline__ void prefetch_l2(const T* p, size_t begin, size_t bytes, uint lane, uint lanes) {
  const char* base = reinterpret_cast<const char*>(p);
  for (size_t at = (begin & ~size_t(127)) + 128 * size_t(lane); at < begin + bytes; at += 128 * size_t(lanes)) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(base + at));
  }
}

// LATHE_UNROLL before a loop of constant trip count: unroll it fully (register arrays indexed by
// its variable then stay in registers).
#define LATHE_UNROLL _Pragma("unroll")

// ---- thread ids (MSL kernel attributes) -------------------------------------------------------
// CUDA launches whole threadgroups (the grid is rounded up), so bodies bound-check as on Metal.
__device__ __forceinline__ uint3 lathe_thread_position_in_grid() {
  return make_uint3(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y,
                    blockIdx.z * blockDim.z + threadIdx.z);
}
__device__ __forceinline__ uint lathe_thread_index_in_threadgroup() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
__device__ __forceinline__ uint3 lathe_threads_per_threadgroup() {
  return make_uint3(blockDim.x, blockDim.y, blockDim.z);
}
#define thread_position_in_grid (lathe_thread_position_in_grid())
#define threadgroup_position_in_grid (blockIdx)
#define thread_position_in_threadgroup (threadIdx)
#define threads_per_threadgroup (lathe_threads_per_threadgroup())
#define thread_index_in_threadgroup (lathe_thread_index_in_threadgroup())
// SIMD width is 32 on both sides (Apple SIMD groups, NVIDIA warps).
#define thread_index_in_simdgroup (lathe_thread_index_in_threadgroup() & 31u)
#define simdgroup_index_in_threadgroup (lathe_thread_index_in_threadgroup() >> 5)

// ---- threadgroup barrier ------------------------------------------------------------------------
namespace mem_flags {
enum lathe_mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
}
__device__ __forceinline__ void threadgroup_barrier(int) { __syncthreads(); }

// simdgroup_barrier: orders threadgroup memory between the lanes of one SIMD group (warp).
__device__ __forceinline__ void simdgroup_barrier(int) { __syncwarp(); }

// ---- SIMD-group functions over a full warp ------------------------------------------------------
// Like Metal's, these assume every lane of the SIMD group is active: bodies never return early
// from a lane that a later SIMD function needs.
template <typename T>
__device__ __forceinline__ T simd_shuffle_xor(T v, ushort mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
template <typename T>
__device__ __forceinline__ T simd_sum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
template <typename T>
__device__ __forceinline__ T simd_max(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    T other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}
template <typename T>
__device__ __forceinline__ T simd_broadcast_first(T v) {
  return __shfl_sync(0xffffffffu, v, __ffs(__activemask()) - 1);
}
