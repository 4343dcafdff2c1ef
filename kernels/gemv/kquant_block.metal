// The 32 weights of part c (0..7) of a K-quant super-block in GGUF's own layout into v[32], in
// float32 as reference/kquant.py (GGML's dequantize_row_*) computes them: Q4_K (QTYPE 2) and Q5_K
// (3) d * sc * q - dmin * m, Q6_K (4) d * scale * (q - 32). Shared by dequantize.metal and the
// embedding (loop/embed.metal). The scope names: KQ_BYTES (the blocks, bytes), base (the
// super-block's first byte), c, v and QTYPE.
{
  if (QTYPE == 4) {
    // ql[128] low nibbles, qh[64] high bit pairs, int8 scales[16] (one a 16 weights), fp16 d; the
    // 256 weights as two halves of 128, each four parts of 32 over 64 ql bytes and 32 qh bytes
    const uint half_at = c / 4, part = c % 4;
    const float d = float(as_type<half>(ushort(uint(KQ_BYTES[base + 208]) | (uint(KQ_BYTES[base + 209]) << 8))));
    for (uint l = 0; l < 32; ++l) {
      const uint low = uint(KQ_BYTES[base + half_at * 64 + (part & 1u) * 32 + l]);
      const uint high = (uint(KQ_BYTES[base + 128 + half_at * 32 + l]) >> (2 * part)) & 3u;
      const uint s = uint(KQ_BYTES[base + 192 + half_at * 8 + part * 2 + l / 16]);
      const float scale = float(int(s) - int((s & 128u) << 1));
      const uint level = (part >= 2 ? low >> 4 : low & 15u) | (high << 4);
      v[l] = d * scale * float(int(level) - 32);
    }
  } else {
    // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins (GGML's get_scale_min_k4), Q5_K's 32
    // bytes of fifth bits (bit c of byte l), then the nibbles: in each 64 weights, byte l holds
    // weight l low and weight l + 32 high
    const float d = float(as_type<half>(ushort(uint(KQ_BYTES[base]) | (uint(KQ_BYTES[base + 1]) << 8))));
    const float dmin = float(as_type<half>(ushort(uint(KQ_BYTES[base + 2]) | (uint(KQ_BYTES[base + 3]) << 8))));
    const uint at = base + 4;
    const uint sc = c < 4 ? uint(KQ_BYTES[at + c]) & 63u : (uint(KQ_BYTES[at + c + 4]) & 15u) | ((uint(KQ_BYTES[at + c - 4]) >> 6) << 4);
    const uint mn = c < 4 ? uint(KQ_BYTES[at + c + 4]) & 63u : (uint(KQ_BYTES[at + c + 4]) >> 4) | ((uint(KQ_BYTES[at + c]) >> 6) << 4);
    const float scale = d * float(sc), offset = dmin * float(mn);
    const uint quants = base + (QTYPE == 3 ? 48 : 16) + c / 2 * 32;
    for (uint l = 0; l < 32; ++l) {
      uint level = (uint(KQ_BYTES[quants + l]) >> (4 * (c % 2))) & 15u;
      if (QTYPE == 3) level |= ((uint(KQ_BYTES[base + 16 + l]) >> c) & 1u) << 4;
      v[l] = scale * float(level) - offset;
    }
  }
}
