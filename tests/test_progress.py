"""harness.progress: a bar on a terminal, plain lines elsewhere, nothing when disabled."""

from __future__ import annotations

import io

from harness.progress import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_plain_lines_and_a_final_one():
    out = io.StringIO()
    assert list(progress(range(5), 5, "check rope", every=0.0, stream=out)) == list(range(5))
    lines = out.getvalue().splitlines()
    assert lines[:5] == [f"check rope: {n}/5 after 0 s" for n in range(1, 6)]
    assert lines[-1] == "check rope: 5/5 in 0 s"


def test_a_terminal_gets_one_bar_and_disabled_gets_nothing():
    term = _Terminal()
    list(progress(range(3), 3, "bench", stream=term))
    assert term.getvalue().count("\r") == 3 and term.getvalue().endswith("3/3   0.0s\n")
    quiet = io.StringIO()
    list(progress(range(3), 3, "bench", enabled=False, stream=quiet))
    assert quiet.getvalue() == ""
