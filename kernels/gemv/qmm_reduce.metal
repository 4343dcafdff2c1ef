// The second launch of a split qmm (qmm.metal's LATHE_SPLIT): Y[m, col] from the KS threadgroups'
// float32 partial sums of row col (part [KS, M, N]), added in order, then the epilogue qmm has
// without a split: act(gate) * up (LATHE_GATED: gate at col, up at N / 2 + col) and the residual,
// in float32 before Y's one rounding. A thread an output.
//
// Constants: M, KS. Inputs: part (float [KS, M, N]), dims (int32: N, K); LATHE_RESIDUAL: residual
// (half [M, N_out]). Output: y (half [M, N_out]; N_out = N, or N / 2 gated).
const uint n = uint(dims[0]);
const uint n_out = LATHE_GATED ? n / 2 : n;
const uint i = thread_position_in_grid.x;
if (i >= M * n_out) return;
const uint m = i / n_out, col = i % n_out;
float out = 0.0f;
#if LATHE_GATED
float up = 0.0f;
#endif
for (uint s = 0; s < KS; ++s) {
  out += part[(s * M + m) * n + col];
#if LATHE_GATED
  up += part[(s * M + m) * n + n_out + col];
#endif
}
#if LATHE_GATED
out = gate_act<LATHE_ACT>(out) * up;
#endif
#if LATHE_RESIDUAL
out += float(residual[i]);
#endif
y[i] = half(out);
