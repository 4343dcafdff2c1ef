"""kernels.options: the declared experiment options, parsed, applied and restored."""

from __future__ import annotations

import pytest

from kernels import gemv, options


def test_parse_reads_each_kind_and_names_the_option_when_wrong():
    assert options.parse("seams=off, attn-partition=128,attn_query_split=0,gemv_tuning=R=4+NSIMD=4") == dict(
        seams=False, attn_partition=128, attn_query_split=0, gemv_tuning="R=4+NSIMD=4")
    assert options.parse("attn_partition=auto,inline_source=yes") == dict(attn_partition=None, inline_source=True)
    assert options.parse("qmm_prologue=auto") == dict(qmm_prologue="auto")
    assert options.parse("qmm_prologue=off") == dict(qmm_prologue=False)
    assert options.parse("") == {}
    for text, said in [("seams", "name=value"), ("seams=2", "option seams"), ("nosuch=1", "unknown option"),
                       ("attn_query_split=-1", "whole number"), ("gemv_tuning=R", "KEY=INT"),
                       ("qmm_prologue=off,qmm_prologue=on", "given twice")]:
        with pytest.raises(ValueError, match=said):
            options.parse(text)


def test_use_restores_every_option_and_describe_names_what_differs():
    before = options.describe()
    with options.use(seams=True, attn_partition=64):
        assert options.get("seams") is True and options.get("attn_partition") == 64
        assert options.describe() == "seams=on,attn_partition=64"
        options.set_options({"pad_constants": False})  # set inside the block: undone too
    assert options.describe() == before == ""


def test_gemv_tuning_is_applied_from_the_defaults_and_undone():
    default = {q: dict(gemv.TUNING[q]) for q in ("q4_0", "q8_0")}
    with options.use(gemv_tuning="R=4+SEAM_SLOTS=0"):
        assert gemv.TUNING["q4_0"]["R"] == gemv.TUNING["q8_0"]["R"] == 4 and gemv.TUNING["SEAM_SLOTS"] == 0
        options.set_options({"gemv_tuning": "NSIMD=4"})  # a new setting starts from the defaults
        assert gemv.TUNING["q4_0"]["R"] == 2 and gemv.TUNING["q4_0"]["NSIMD"] == 4
    assert {q: gemv.TUNING[q] for q in default} == default and gemv.TUNING["SEAM_SLOTS"] == 2
    with pytest.raises(ValueError, match="bad GEMV tuning"):  # the form passes; the key does not
        options.set_options(options.parse("gemv_tuning=PREFETCH=1"))
    assert options.get("gemv_tuning") == ""  # a refused value is not kept


def test_the_environment_is_read_in_one_place():
    found = options._from_environment({"LATHE_SET": "seams=off,attn_partition=256", "LATHE_ATTN_PARTITION": "128",
                                       "LATHE_INLINE_SOURCE": "1"})
    assert found == dict(seams=False, attn_partition=128, inline_source=True)  # one variable wins over LATHE_SET
    with pytest.raises(ValueError, match="LATHE_SEAMS"):
        options._from_environment({"LATHE_SEAMS": "maybe"})


def test_the_readme_lists_every_option():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for o in options.DECLARED:
        assert f"| `{o.name}` | {o.show(o.default)} |" in readme, o.name


def test_an_arms_options_column_is_the_run_s_own_with_its_changes():
    """describe_under: the options in force with an --ab arm's changes made, and nothing changed
    after."""
    with options.use(serve_mega_rows=2):
        assert options.describe_under({"block_prefetch": False}) == "serve_mega_rows=2,block_prefetch=off"
        assert options.describe_under({}) == options.describe() == "serve_mega_rows=2"
    assert options.describe() == ""
