// Chunk `blk` of a repacked matrix (kernels.gemv.repack) decoded into float v[32] (its 32 weights
// in K order), in float32 as the references compute them. Shared by dequantize.metal (PACKED) and
// the quantized GEMM (qmm.metal). The scope names: PC_BYTES (the repacked bytes), blk (the chunk:
// row * K / 32 + chunk of the row), chunks (N * K / 32), v and QTYPE.
// Q4_0 (QTYPE 0) and Q8_0 (1): the chunk's 16 or 32 bytes of quants (GGUF's order: Q4_0 byte l
// holds weight l low and l + 16 high), then every block's fp16 d after all the quants. The other
// types (reference/kquant.py's layout): 16 bytes of low nibbles, the chunk's high bits (Q5_K one
// word, Q6_K two), the scales.
{
if (QTYPE <= 1) {
  constexpr uint QB = QTYPE == 0 ? 16u : 32u;  // bytes of quants a chunk
  const float d = float(as_type<half>(load_wide<ushort>(PC_BYTES, chunks * (QB / 2) + blk)));
  for (uint u = 0; u < QB / 16; ++u) {
    const uint4 word = load_wide<uint4>(PC_BYTES, blk * (QB / 16) + u);
    const uint w4[4] = {word.x, word.y, word.z, word.w};
    for (uint l = 0; l < 16; ++l) {
      const uint byte = (w4[l / 4] >> (8 * (l % 4))) & 0xffu;
      if (QTYPE == 0) {
        v[l] = float(int(byte & 15u) - 8) * d;
        v[l + 16] = float(int(byte >> 4) - 8) * d;
      } else {
        v[16 * u + l] = float(int(byte) - int((byte & 128u) << 1)) * d;
      }
    }
  }
} else {
  const uint4 lowq = load_wide<uint4>(PC_BYTES, blk);
  const uint lw[4] = {lowq.x, lowq.y, lowq.z, lowq.w};
  constexpr bool FIFTH = QTYPE == 3 || QTYPE == 7 || QTYPE == 8;
  const uint high_at = chunks * 16, scales_at = high_at + chunks * (FIFTH ? 4 : QTYPE == 4 ? 8 : 0);
  uint h0 = 0u, h1 = 0u;
  if (FIFTH) h0 = load_wide<uint>(PC_BYTES, high_at / 4 + blk);
  if (QTYPE == 4) {
    const uint2 h = load_wide<uint2>(PC_BYTES, high_at / 8 + blk);
    h0 = h.x, h1 = h.y;
  }
  float lo_scale, hi_scale, offset = 0.0f;  // values 0..15 and 16..31 of the chunk
  if (QTYPE == 4) {
    const uint pair = uint(load_wide<ushort>(PC_BYTES, scales_at / 2 + blk));
    const float d = float(as_type<half>(load_wide<ushort>(PC_BYTES, (scales_at + chunks * 2) / 2 + blk / 8)));
    lo_scale = d * float(int(pair << 24) >> 24);
    hi_scale = d * float(int(pair << 16) >> 24);
  } else if (QTYPE == 9) {  // IQ4_NL: d a block
    lo_scale = hi_scale = float(as_type<half>(load_wide<ushort>(PC_BYTES, scales_at / 2 + blk)));
  } else if (QTYPE == 10) {  // IQ4_XS: d (ls - 32) of sub-block blk % 8, from its super-block's head
    const uint2 head = load_wide<uint2>(PC_BYTES, scales_at / 8 + blk / 8);
    const uint j = blk % 8;
    const uint ls = ((head.y >> (4 * j)) & 15u) | (((head.x >> (16 + 2 * j)) & 3u) << 4);
    lo_scale = hi_scale = float(as_type<half>(ushort(head.x & 0xffffu))) * float(int(ls) - 32);
  } else if (QTYPE == 7) {  // Q5_0: d (q - 16)
    lo_scale = hi_scale = float(as_type<half>(load_wide<ushort>(PC_BYTES, scales_at / 2 + blk)));
    offset = 16.0f * lo_scale;
  } else if (QTYPE >= 6) {  // Q4_1, Q5_1: d q + m
    const half2 dm = as_type<half2>(load_wide<uint>(PC_BYTES, scales_at / 4 + blk));
    lo_scale = hi_scale = float(dm.x);
    offset = -float(dm.y);
  } else {
    const uint4 head = load_wide<uint4>(PC_BYTES, scales_at / 16 + blk / 8);
    const uint j = blk % 8, shift = 8 * (j % 4);
    const uint b0 = (head.y >> shift) & 255u, b1 = (head.z >> shift) & 255u, b2 = (head.w >> shift) & 255u;
    const uint sc = j < 4 ? b0 & 63u : (b2 & 15u) | ((b0 >> 6) << 4);
    const uint mn = j < 4 ? b1 & 63u : (b2 >> 4) | ((b1 >> 6) << 4);
    const half2 dd = as_type<half2>(head.x);
    lo_scale = hi_scale = float(dd.x) * float(sc);
    offset = float(dd.y) * float(mn);
  }
  for (uint l = 0; l < 32; ++l) {
    const uint hi_half = l / 16, t = l % 16 / 4, b = l % 4;  // byte b of word t
    uint level = (lw[t] >> (8 * b + 4 * hi_half)) & 15u;
    if (FIFTH) level |= ((h0 >> (8 * b + 4 * hi_half + t)) & 1u) << 4;
    if (QTYPE == 4) level |= (((hi_half ? h1 : h0) >> (8 * b + 2 * t)) & 3u) << 4;
    if (QTYPE == 4) {
      v[l] = (hi_half ? hi_scale : lo_scale) * float(int(level) - 32);
    } else if (QTYPE >= 9) {
      v[l] = lo_scale * float(int(char(iq4_levels(level).x & 255u)));
    } else {
      v[l] = lo_scale * float(level) - offset;
    }
  }
}
}
