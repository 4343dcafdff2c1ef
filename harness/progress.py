"""A dependency-free progress report on stderr for long runs (checks, benchmarks): a bar redrawn
in place on a terminal; elsewhere (a log, a pipe, the lent device's captured output) a plain line
at most every `every` seconds, and one at the end."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, enabled: bool | None = None,
             every: float = 30.0, stream=None) -> Iterator[T]:
    """Yield items while reporting `label n/total elapsed` (see the module doc); enabled=False:
    silent."""
    stream = stream or sys.stderr
    bar = stream.isatty() if enabled is None else enabled and stream.isatty()
    lines = enabled is not False and not bar
    start = last = time.perf_counter()
    width = 30
    n = 0
    for n, item in enumerate(items, 1):
        yield item
        now = time.perf_counter()
        if bar:
            done = int(width * n / max(total, 1))
            stream.write(f"\r{label} [{'#' * done}{'.' * (width - done)}] {n}/{total} {now - start:5.1f}s")
            stream.flush()
        elif lines and now - last >= every:
            stream.write(f"{label}: {n}/{total} after {now - start:.0f} s\n")
            stream.flush()
            last = now
    if bar:
        stream.write("\n")
    elif lines:
        stream.write(f"{label}: {n}/{total} in {time.perf_counter() - start:.0f} s\n")
    stream.flush()
