"""Diagnostic patches of kernels/gemv/x_stage.metal (never landed): which part of X' staging costs
the batch form's tickets. Usage: python patch_xstage.py {norms|copy|magic} (edits the file in place)."""
import sys, pathlib
p = pathlib.Path("kernels/gemv/x_stage.metal")
s = p.read_text()
mode = sys.argv[1]
def sub(a, b):
    global s
    assert a in s, a
    s = s.replace(a, b)
if mode in ("norms", "copy"):
    # no RMS pass: inv_rms = 1 (the codes do not depend on it; only the scale does)
    sub("  if (cb0 == 0) {\n    // RMSNorm", "  if (cb0 == 0 && false) {\n    // RMSNorm")
    sub("#endif\n  // Every SIMD group is done", "  if (cb0 == 0 && tid == 0) for (uint m = 0; m < uint(M); ++m) inv_rms[m] = 1.0f;\n#endif\n  // Every SIMD group is done")
if mode == "copy":
    # the item loop: X's raw 32 bytes an item stored as the codes (what copying codes made by
    # another ticket would cost), no arithmetic
    start = s.index("  for (uint base = 0; base < halves;")
    end = s.index("  threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n#undef X_EIGHT")
    s = s[:start] + """  for (uint base = 0; base < halves; base += NT) {
    const uint i = base + tid;
    const uint ic = min(i, halves - 1);
    const uint m = ic / (cnb * 2);
    const uint e = (ic % (cnb * 2)) * 16;
    const uint k0 = cb0 * 32 + e;
#if LATHE_PROLOGUE == 2
    const auto src = x + m * 2 * k;
#else
    const auto src = x + m * k;
#endif
    uint packed[8];
#if LATHE_X32
    LATHE_UNROLL for (uint q = 0; q < 2; ++q) { const uint4 w_ = load_wide<uint4>(src, k0 / 4 + q); packed[4*q] = w_.x; packed[4*q+1] = w_.y; packed[4*q+2] = w_.z; packed[4*q+3] = w_.w; }
#else
    LATHE_UNROLL for (uint q = 0; q < 2; ++q) { const uint4 w_ = load_wide<uint4>(src, k0 / 8 + q); packed[4*q] = w_.x; packed[4*q+1] = w_.y; packed[4*q+2] = w_.z; packed[4*q+3] = w_.w; }
#endif
    if (i < halves) {
      X_STORE(m, e, packed);
      if (i % 2 == 0) {
        const uint blk = m * (XCHUNK / 32) + e / 32;
        x_scale[blk] = 1.0f / 32767.0f;
        x_sum[blk] = 0;
      }
    }
  }
""" + s[end:]
if mode == "magic":
    # rint by the float adder: v * inv + 1.5 * 2^23 rounds to an integer (ties to even) held in
    # the low mantissa bits; two codes packed by one byte permute
    sub("const int a = int(rint(v[u][2 * j] * inv)), b = int(rint(v[u][2 * j + 1] * inv));",
        "const int a = int(as_type<uint>(fma(v[u][2 * j], inv, 12582912.0f)) - 0x4B400000u), b = int(as_type<uint>(fma(v[u][2 * j + 1], inv, 12582912.0f)) - 0x4B400000u);")
p.write_text(s)
print("patched", mode)
