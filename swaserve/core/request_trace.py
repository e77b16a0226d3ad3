"""First-token timestamps per request, for a time-to-first-token breakdown across processes.

With `SWASERVE_REQUEST_TRACE=PREFIX` set, each serving process appends one JSON line per request to
`PREFIX.<role>` (`core<pid>`, `frontend0`, ...) when the request's first token passes it:
`[request_id, *t_in, t_first]`, monotonic seconds (comparable across processes on Linux). In the
frontend t_in is (its route handler started, the request was sent to the core) and t_first is when
the first token's step message arrived; in the core t_in is when the request was taken from the
input socket and t_first when the message carrying its first token was sent.
`benchmarks/serving_vs_offline.py` joins these with its clients' timings. Off by default: then every
method returns at once.
"""

from __future__ import annotations

import json
import os
from typing import TextIO

ENV = "SWASERVE_REQUEST_TRACE"


class RequestTrace:
    def __init__(self, role: str):
        prefix = os.environ.get(ENV)
        self._file: TextIO | None = open(f"{prefix}.{role}", "a", buffering=1) if prefix else None
        self._start: dict[str, tuple[float, ...]] = {}  # request -> t_in, until its first token or its end

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def arrived(self, request_id: str, *t_in: float) -> None:
        if self._file is not None:
            self._start[request_id] = t_in

    def first_token(self, request_id: str, t: float) -> None:
        if self._file is not None and (t_in := self._start.pop(request_id, None)) is not None:
            self._file.write(json.dumps([request_id, *t_in, t]) + "\n")

    def forget(self, request_id: str) -> None:
        """The request ended without a first token passing here (aborted, refused, failed)."""
        self._start.pop(request_id, None)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
