"""A dependency-free progress bar on stderr for long runs (checks, benchmarks)."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, enabled: bool | None = None) -> Iterator[T]:
    """Yield items while drawing `label [#####.....] n/total elapsed` (only on a terminal)."""
    stream = sys.stderr
    show = stream.isatty() if enabled is None else enabled
    start = time.perf_counter()
    width = 30
    for n, item in enumerate(items, 1):
        yield item
        if show:
            done = int(width * n / max(total, 1))
            stream.write(
                f"\r{label} [{'#' * done}{'.' * (width - done)}] {n}/{total} "
                f"{time.perf_counter() - start:5.1f}s"
            )
            stream.flush()
    if show:
        stream.write("\n")
        stream.flush()
