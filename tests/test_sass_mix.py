"""harness.tools.sass_mix on a cuobjdump listing of our own: instructions, opcodes, loops."""

from __future__ import annotations

import pytest

from harness.tools import sass_mix

LISTING = """
\tcode for sm_90a
\t\tFunction : k
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe20000000800 */
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, 0xf000f ;     /* 0x0 */
        /*0020*/                   LOP3.LUT R3, R2, R4, RZ, 0xc0, !PT ;   /* 0x0 */
        /*0030*/                   HMMA.16816.F32 R8, R4, R6, R8 ;        /* 0x0 */
        /*0040*/                   LDS.128 R4, [R5] ;                     /* 0x0 */
        /*0050*/               @P0 BRA 0x30 ;                             /* 0x0 */
        /*0060*/                   HADD2 R3, R3, -1032, -1032 ;           /* 0x0 */
        /*0070*/              @!P1 BRA 0x10 ;                             /* 0x0 */
        /*0080*/                   BRA 0xb0 ;                             /* 0x0 */
        /*0090*/                   EXIT ;                                 /* 0x0 */
"""


def test_instructions_and_opcodes():
    ins = sass_mix.instructions(LISTING)
    assert [a for a, _ in ins] == list(range(0, 0xA0, 0x10))
    assert [sass_mix.opcode(t) for _, t in ins][:6] == ["LDC", "IMAD", "LOP3", "HMMA", "LDS", "BRA"]


def test_loops_are_backward_branches_counted_by_opcode():
    """Two loops (0x30..0x50 nested in 0x10..0x70), largest first; the forward branch is none."""
    found = sass_mix.loops(LISTING)
    assert [(lp.start, lp.end, lp.size) for lp in found] == [(0x10, 0x70, 7), (0x30, 0x50, 3)]
    assert found[0].ops == {"IMAD": 1, "LOP3": 1, "HMMA": 1, "LDS": 1, "BRA": 2, "HADD2": 1}
    assert "loop 0: 7 instructions" in sass_mix.report(LISTING, 3)


def test_a_listing_without_loops_is_counted_whole():
    flat = "\n".join(line for line in LISTING.splitlines() if "BRA" not in line)
    assert sass_mix.report(flat, 2) == "no loop; 7 instructions: LDC 1, IMAD 1"


def test_qmm_mma_instance_is_the_launch_rules():
    from kernels import gemv

    path, stem, consts = sass_mix.qmm_mma_constants("q4_0,16,28672,4096", ["ks=2"])
    geo = gemv.qmm_mma_geometry(16, 28672, 4096, "q4_0", False)
    assert (path, stem) == (gemv.QMM_MMA, "lathe_qmm_mma")
    assert consts == dict(QT=0, ROWS8=0, M=16, N=28672, K=4096, TM=geo["tm"], NW=geo["nw"], KW=1, KS=2,
                          SG=geo["sg"], STAGES=geo["stages"], PF=geo["pf"], GATED=0, RESID=0, SK=0)
    assert sass_mix.qmm_mma_constants("q8_0,8,2048,1024,gated", [])[2]["GATED"] == 1
    assert sass_mix.qmm_mma_constants("q8_0,8,2048,1024,gated,rows8", [])[2] == \
        dict(sass_mix.qmm_mma_constants("q8_0,8,2048,1024,gated", [])[2], ROWS8=1)


def test_missing_cuobjdump_says_where_to_get_it(monkeypatch):
    monkeypatch.setattr(sass_mix.shutil, "which", lambda name: None)
    monkeypatch.setattr(sass_mix.sys, "path", [])
    with pytest.raises(FileNotFoundError, match="nvidia-cuda-cuobjdump"):
        sass_mix.cuobjdump()
