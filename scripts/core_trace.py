"""Summarise an engine-core step trace (`SWASERVE_CORE_TRACE=FILE swaserve serve ...`): per busy period
(split at idle gaps over 1 s), steps by kind with their time, batch size and tokens reported, and the
time the core spent between steps (polling inputs, sending outputs).

    python scripts/core_trace.py FILE [--buckets 0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics as st


def periods(rows: list[list]) -> list[list[list]]:
    out: list[list[list]] = [[]]
    for prev, row in zip([None, *rows], rows):
        if prev is not None and row[0] - (prev[0] + prev[1]) > 1.0:
            out.append([])
        out[-1].append(row)
    return [p for p in out if p]


def summarise(rows: list[list], bucket: float) -> None:
    t0, end = rows[0][0], rows[-1][0] + rows[-1][1]
    reported = sum(r[3] for r in rows)
    print(f"{len(rows)} steps over {end - t0:.2f} s, {sum(r[1] for r in rows):.2f} s inside step(), "
          f"{reported} tokens reported ({reported / (end - t0):.0f}/s)")
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(rows, rows[1:])] or [0.0]
    print(f"  between steps: {sum(gaps):.2f} s in all, p50 {1e3 * st.median(gaps):.2f} ms, max {1e3 * max(gaps):.1f} ms")
    kinds: dict[str, list[list]] = {}
    for r in rows:
        kinds.setdefault((r[2] or ["none"])[0], []).append(r)
    for kind, rs in kinds.items():
        shape = [r[2] or ["none", 0, 0] for r in rs]
        print(f"  {kind:<8}{len(rs):>6} steps {sum(r[1] for r in rs):7.2f} s  step p50 {1e3 * st.median(r[1] for r in rs):6.2f} ms"
              f"  requests {st.mean(s[1] for s in shape):6.1f}  tokens {st.mean(s[2] for s in shape):7.1f}"
              f"  reported {sum(r[3] for r in rs)}")
    buckets: dict[int, list[float]] = {}
    for r in rows:
        b = buckets.setdefault(int((r[0] - t0) / bucket), [0, 0, 0.0])
        b[0] += 1
        b[1] += r[3]
        b[2] += r[1]
    for i in sorted(buckets):
        n, tok, busy = buckets[i]
        print(f"    t={i * bucket:5.1f}s {n:5d} steps {tok:7d} tokens  in step() {100 * busy / bucket:4.0f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--buckets", type=float, default=0.5, help="timeline bucket, seconds")
    args = p.parse_args()
    with open(args.trace) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for i, period in enumerate(periods(rows)):
        print(f"== busy period {i}")
        summarise(period, args.buckets)


if __name__ == "__main__":
    main()
