"""The rows (tokens) of the model step being run or captured, for launch choices that depend on them: the
kernels' PDL row limit (`kernels/pdl.py`, SWASERVE_PDL_MAX_ROWS). The runner states them around an eager
forward and each graph capture (`within`); `current()` is None outside a step. No imports: the runner sets
it on machines without Triton too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_rows: int | None = None


def current() -> int | None:
    return _rows


@contextlib.contextmanager
def within(n: int) -> Iterator[None]:
    """The code inside runs (or captures) a step of `n` rows; the previous value comes back after."""
    global _rows
    outer, _rows = _rows, n
    try:
        yield
    finally:
        _rows = outer
