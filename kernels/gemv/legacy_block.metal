// The 32 weights of one GGUF Q4_1 (QTYPE 6), Q5_0 (7) or Q5_1 (8) block in GGUF's own layout into
// v[32], in float32 as reference/quant.py (GGML's dequantize_row_*) computes them: Q4_1 d q + m
// (20 bytes: fp16 d, fp16 m, 16 of nibbles), Q5_0 d (q - 16) (22: d, the fifth bits as one
// little-endian uint32, nibbles), Q5_1 d q + m (24: d, m, fifth bits, nibbles). In the nibbles,
// byte l holds weight l low and weight l + 16 high. Blocks are not 4-byte aligned: bytes only.
// Shared by dequantize.metal and the embedding (loop/embed.metal). The scope names: LB_BYTES
// (the blocks, bytes), base (the block's first byte), v and QTYPE.
{
  const float d = float(as_type<half>(ushort(uint(LB_BYTES[base]) | (uint(LB_BYTES[base + 1]) << 8))));
  const float m = QTYPE == 7 ? -16.0f * d
                             : float(as_type<half>(ushort(uint(LB_BYTES[base + 2]) | (uint(LB_BYTES[base + 3]) << 8))));
  const uint heads = QTYPE == 7 ? 2u : 4u;  // d, or d and m
  uint fifth = 0u;
  if (QTYPE != 6) {
    for (uint j = 0; j < 4; ++j) fifth |= uint(LB_BYTES[base + heads + j]) << (8 * j);
  }
  const uint quants = base + heads + (QTYPE == 6 ? 0u : 4u);
  for (uint l = 0; l < 16; ++l) {
    const uint byte = uint(LB_BYTES[quants + l]);
    const uint lo = (byte & 15u) | (((fifth >> l) & 1u) << 4);
    const uint hi = (byte >> 4) | (((fifth >> (l + 16)) & 1u) << 4);
    v[l] = d * float(lo) + m;
    v[l + 16] = d * float(hi) + m;
  }
}
