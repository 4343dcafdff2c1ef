// Quantized GEMV, v1: Y[M, N] = X[M, K] @ W^T with W in GGUF blocks (fp16 activations and
// output, fp32 accumulation). W's rows hold K/32 blocks of BB bytes: an fp16 scale d, then
//   Q4_0 (QTYPE 0, BB 18): 16 bytes, byte j = q_j | q_{j+16} << 4, weight = (q - 8) * d;
//   Q8_0 (QTYPE 1, BB 34): 32 int8, weight = q * d.
// The weight buffer comes twice, as bytes (w) and as halves (w_half, for the scales: a block
// starts on an even byte), so that no bit casts are needed.
//
// v1 is the plain design: one SIMD group per output row, lane l takes blocks l, l+32, ..., and a
// SIMD sum finishes the row. NSIMD rows per threadgroup.
// Constants: QTYPE, M (rows of X, 1..4), NSIMD. Inputs: x, w, w_half, dims (int32: N, K).
constexpr uint BB = QTYPE == 0 ? 18 : 34;
const uint lane = thread_index_in_simdgroup;
const uint row = threadgroup_position_in_grid.x * uint(NSIMD) + simdgroup_index_in_threadgroup;
const uint n = uint(dims[0]);
const uint k = uint(dims[1]);
const uint nb = k / 32;
float acc[M];
for (uint m = 0; m < uint(M); ++m) {
  acc[m] = 0.0f;
}
if (row < n) {  // no early return: the SIMD sum below needs every lane
  for (uint b = lane; b < nb; b += 32) {
    const uint blk = row * nb + b;
    const float d = float(w_half[blk * (BB / 2)]);
    const auto q = w + blk * BB + 2;
    for (uint m = 0; m < uint(M); ++m) {
      const auto xb = x + m * k + b * 32;
      float s = 0.0f;
      if (QTYPE == 0) {
        for (uint j = 0; j < 16; ++j) {
          const int bits = int(q[j]);
          s += float((bits & 15) - 8) * float(xb[j]) + float((bits >> 4) - 8) * float(xb[j + 16]);
        }
      } else {
        for (uint j = 0; j < 32; ++j) {
          const int bits = int(q[j]);
          s += float(bits - ((bits & 128) << 1)) * float(xb[j]);  // int8 from its byte
        }
      }
      acc[m] += d * s;
    }
  }
}
for (uint m = 0; m < uint(M); ++m) {
  const float total = simd_sum(acc[m]);
  if (row < n && lane == 0) {
    y[m * n + row] = half(total);
  }
}
