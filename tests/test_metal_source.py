"""harness.metal: the Metal source that mx.fast.metal_kernel builds around a body, written as MLX's
generator writes it (kernels/msl/NOTES.md has the rules), on any machine (CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from harness.metal import ATTRIBUTES, kernel_name, launch_source, metal_source


def test_signature_follows_mlx_rules():
    """A large input in device memory with the _shape argument its body names, a 0-d input by
    reference in constant memory, the output, and the one thread attribute the body uses."""
    body = "uint i = thread_position_in_grid.x;\nout[i] = a[i] * a_shape[0] + s;"
    got = metal_source("k", body, "// header", [("a", mx.float32, (1024,)), ("s", mx.int32, ())],
                       [("out", mx.float16)], {})
    want = ("// header\n\n"
            "[[kernel]] void custom_kernel_k_float_int32_ts_float16_t(\n"
            "  const device float* a [[buffer(0)]],\n"
            "  const constant int* a_shape [[buffer(1)]],\n"
            "  const constant int32_t& s [[buffer(2)]],\n"
            "  device float16_t* out [[buffer(3)]],\n"
            "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
            f"{body}\n}}\n")
    assert got == want


def test_templates_small_inputs_and_attribute_order():
    """Template constants in order (a bool as 1/0), the explicit instantiation under the kernel's
    host name, an input under 8 elements in constant memory, attributes in MLX's table order
    whatever order the body names them in (a mention in a comment counts)."""
    body = ("uint t = thread_index_in_threadgroup;  // threadgroup_position_in_grid\n"
            "uint l = thread_index_in_simdgroup;\ny[t] = dims[0] + l;")
    got = metal_source("g", body, "", [("dims", mx.int32, (3,)), ("w", mx.uint8, (64,))], [("y", mx.float32)],
                       {"QTYPE": 2, "NEOX": True, "T": mx.float16})
    k = "custom_kernel_g__2_1_float16_t_int32_tc_uint8_t_float"
    assert k == kernel_name("g", {"QTYPE": 2, "NEOX": True, "T": mx.float16},
                            [("int32_t", 1, 3), ("uint8_t", 1, 64)], ["float"])
    assert "template <int QTYPE, bool NEOX, typename T>\n[[kernel]] void " + k + "(\n" in got
    assert "  const constant int32_t* dims [[buffer(0)]],\n  const device uint8_t* w [[buffer(1)]],\n" in got
    attrs = [line.split()[1] for line in got.splitlines() if line.startswith("  uint")]
    assert attrs == ["thread_index_in_simdgroup", "thread_index_in_threadgroup", "threadgroup_position_in_grid"]
    assert got.endswith(f'template [[host_name("{k}")]] [[kernel]] decltype({k}<2, 1, float16_t>) '
                        f'{k}<2, 1, float16_t>;\n')


def test_a_recorded_launch_gets_lathe_h_and_its_whole_body():
    """A launch the checks make (recorded, not run): the header is lathe.h in its Metal form (no
    CUDA compat header), the body's includes are pasted in, the constants are template
    arguments."""
    from kernels import gemv
    from kernels.runtime import recording
    from reference.quant import quantize

    w = gemv.repack(mx.array(quantize(np.ones((64, 256), np.float32), "q4_0")), "q4_0", 64, 256)
    with recording() as rec:
        gemv.gemv_v3(mx.zeros((1, 256), mx.float16), w, "q4_0", 64, 256)
    (job,) = rec.jobs
    src = launch_source(job)
    assert "#include <metal_stdlib>" in src and "__CUDACC__" not in src.split("[[kernel]]")[0]
    assert '#include "' not in src  # every part of the body pasted in
    assert "const device uint8_t* w [[buffer(1)]]" in src and "const constant int32_t* dims" in src
    k = "custom_kernel_lathe_gemv_v3__0_1_1_1_1_256_256_1_float16_t_uint8_t_int32_tc_float16_t"
    assert f"template <int QTYPE, int M, int R, int NSIMD, int P, int K, int XCHUNK, int XITEMS>\n[[kernel]] void {k}(" \
        in src
    assert src.endswith(f"decltype({k}<0, 1, 1, 1, 1, 256, 256, 1>) {k}<0, 1, 1, 1, 1, 256, 256, 1>;\n")


def _mlx_strings() -> list[str]:
    from pathlib import Path

    path = Path(__file__).parent / "data" / "mlx-0.32.4-metal-kernel-strings.txt"
    return [line[1:-1] for line in path.read_text().splitlines() if line.startswith('"')]


def test_the_generator_writes_mlx_0_32_4s_own_text():
    """Against the strings of MLX 0.32.4's own generator (its Metal build's libmlx.dylib; the
    Linux wheels have no Metal back end to ask): the thread attributes are MLX's table, in its
    order, each type first named where ours first takes it; and every fixed piece of text our
    signature and instantiation are made of is one of MLX's strings, spaces included."""
    strings = _mlx_strings()
    names = {a for a, _ in ATTRIBUTES}
    table = [s for s in strings if s in names or s in ("uint", "uint3")]
    ours = []
    for a, t in ATTRIBUTES:
        ours.append(a)
        if t not in ours:
            ours.append(t)  # the linker keeps one copy of a string: a type shows where first used
    assert table == ours
    body = ("uint i = thread_position_in_grid.x; out[i] = a[i] * a_shape[0] + a_strides[0] + a_ndim;")
    src = metal_source("k", body, "", [("a", mx.float32, (1024,))], [("out", mx.float16)], {"N": 2},
                       atomic_outputs=True)
    pieces = ["[[kernel]] void ", "custom_kernel_", " [[buffer(", "  const constant int* ", "_shape [[buffer(",
              "  const constant int64_t* ", "_strides [[buffer(", "  const constant int& ", "_ndim [[buffer(",
              "  device ", "atomic<", ")]],", ") {", "template <", 'template [[host_name("',
              '")]] [[kernel]] decltype(']
    for piece in pieces:
        assert piece in strings and piece in src, piece
