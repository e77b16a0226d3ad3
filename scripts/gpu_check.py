"""The GPU machine's one command (`bash scripts/gpu_check.sh` wraps it): every GPU test and the quick
benchmarks in one call, sharded over all visible GPUs and run in parallel processes.

Test steps are split into jobs (a test file, or a slice of a long one) that a pool of pytest processes
takes longest-first; each process sees one GPU (`CUDA_VISIBLE_DEVICES`) and compiles its own Triton
kernels, so compile-bound kernel tests and GPU-bound model tests overlap. Tests that need several GPUs
run as jobs that see two, beside the pool (on disjoint pairs at once, each capped at MULTI_JOB_LIMIT_S). Benchmarks run last, alone, so their
timings are not shared with anything. Logs go to $OUT (one file per step, the limit of what comes back
from the device machine); the last lines printed are the summary table with pass/fail counts per step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Per-job logs and junit reports: outside $OUT, whose files the device machine returns only 8 of (the
# step logs, benchmarks.log, gpu_report.jsonl, test_times.json and jobs.tsv).
WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check_work"))
T0 = time.time()  # the run's start: jobs' start offsets in $OUT/jobs.tsv are from here
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
# Opt-in fast paths: graph padding must stay bit-identical with all of them on.
FAST_PATHS = {"SWASERVE_SKINNY_GEMM": "1", "SWASERVE_PDL": "1", "SWASERVE_FUSED_SPLIT_COMBINE": "1"}
# Seconds per test from a full run on one H100 (`$OUT/test_times.json`, copied here; times under the
# run's own contention), to pack tests into jobs of about TARGET_S seconds and start the longest first.
DURATIONS = ROOT / "scripts" / "gpu_check_durations.json"
TARGET_S = 40.0
# The quick benchmarks (step e), in order, alone on the first GPU after the tests.
BENCHMARKS = [("e_decode_bench", ["benchmarks/decode.py", "--quick"]),
              ("f_offline_bench", ["benchmarks/offline_throughput.py", "--num-requests", "128"]),
              ("g_moe_bench", ["benchmarks/moe_kernel.py", "--model", "gpt-oss-20b"])]
BENCH_RESERVE_S = 75.0  # they took 63 s on 4x H100 and 47 s on 4x H200 (2026-11-28)
# Files whose tests hold a large model (fp32 real-shape cuts next to HF's copy): one at a time per GPU.
HEAVY_ESTIMATE_S = 120.0
# A job that sees every GPU runs beside the pool (which keeps a slot per GPU free for it), one such job at a
# time, each capped: a hung collective must not take the call's time from the other steps. A hang dumps
# every thread's stack into the job's log (pytest's faulthandler_timeout) before the job is killed.
MULTI_JOB_LIMIT_S = 360.0  # TP and EP files took 150-290 s beside a full pool on 4x H100 (compiling)
MULTI_GPUS = 2  # GPUs a multi-GPU job sees (every multi_gpu test needs two)
# Niceness of the pool's test processes (and the ptxas they run) while multi-GPU jobs run beside them: those
# are the run's critical path, and on 4x H200 the EP file, compiling beside 28 pool processes on 64 cores,
# went past MULTI_JOB_LIMIT_S (it takes 137 s on 4x H100).
POOL_NICE = 10
HEAVY = ("test_gemma4_vs_hf.py", "test_mimo_v2_flash_vs_hf.py", "test_gpt_oss_vs_hf.py", "test_gemma3_1b_vs_hf.py")


@dataclass
class Step:
    name: str
    paths: list[str]
    marker: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    estimate: float = 15.0  # seconds a test takes when the last run did not time it
    gpus: int = 1  # GPUs one job of this step needs


@dataclass
class Job:
    step: Step
    ids: list[str]  # pytest node ids (or one file path)
    key: str
    estimate: float
    heavy: bool
    result: dict = field(default_factory=dict)


STEPS = [
    Step("a_kernel_tests", ["tests/kernels"], env={"SWASERVE_KERNEL_TESTS_ON_GPU": "1"}, estimate=2.0),
    Step("b_gpu_tests", ["tests/gpu", "tests/unit/test_sampler.py"], marker="gpu and not multi_gpu"),
    Step("c_fast_paths", ["tests/gpu/test_cuda_graph_padding.py"], marker="gpu", env=FAST_PATHS),
    Step("d_multi_gpu", ["tests/gpu"], marker="multi_gpu", gpus=2),
]


def pythonpath() -> str:
    """The repo first, then whatever the caller set (e.g. carried wheels in /tmp/site)."""
    return os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def visible_gpus() -> list[str]:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def collect(step: Step) -> list[str]:
    cmd = [*PYTEST, "--collect-only", *(["-m", step.marker] if step.marker else []), *step.paths]
    env = {**os.environ, **step.env}
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode not in (0, 5):
        print(f"   collection of {step.name} failed (rc={out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def make_jobs(step: Step, ids: list[str], known: dict[str, float]) -> list[Job]:
    """Each file's tests in runs of about `TARGET_S` seconds (by the last run's per-test times, else
    `step.estimate` each), so a long file spreads over several processes and a short one is one."""
    by_file: dict[str, list[str]] = {}
    for i in ids:
        by_file.setdefault(i.split("::")[0], []).append(i)
    jobs = []
    for path, tests in by_file.items():
        parts: list[list[str]] = [[]]
        sums = [0.0]
        for t in tests:
            est = known.get(f"{step.name}:{t}", step.estimate)
            if parts[-1] and sums[-1] + est > TARGET_S:
                parts.append([])
                sums.append(0.0)
            parts[-1].append(t)
            sums[-1] += est
        for n, (part, est) in enumerate(zip(parts, sums)):
            key = f"{step.name}:{path}" + (f"#{n}" if len(parts) > 1 else "")
            heavy = Path(path).name in HEAVY
            if heavy and not any(f"{step.name}:{t}" in known for t in part):
                est = max(est, HEAVY_ESTIMATE_S * len(part))  # a new heavy file: start it early
            jobs.append(Job(step, part, key, est, heavy))
    return jobs


def run_job(job: Job, gpus: list[str], deadline: float, nice: int = 0) -> None:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job.key)
    xml = WORK / "junit" / f"{safe}.xml"
    log = WORK / "jobs" / f"{safe}.log"
    marker = ["-m", job.step.marker] if job.step.marker else []
    left = deadline - time.time()
    if left > 30:  # a hang shows where it is stuck before the job is killed
        marker += ["-o", f"faulthandler_timeout={int(left - 15)}"]
    if job.step.gpus > 1:
        marker.append("-s")  # spawned ranks write to the log directly (their stacks too, at a timeout)
    env = {**os.environ, **job.step.env, "CUDA_VISIBLE_DEVICES": ",".join(gpus), "PYTHONPATH": pythonpath(),
           "PYTHONFAULTHANDLER": "1"}  # SIGABRT at the deadline: every process of the job prints its stacks
    start = time.time()
    with open(log, "w") as f:
        niced = ["nice", "-n", str(nice)] if nice else []  # the binary: preexec_fn is unsafe beside threads
        p = subprocess.Popen([*niced, *PYTEST, f"--junitxml={xml}", *marker, *job.ids], cwd=ROOT, env=env,
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGABRT, 10), (signal.SIGKILL, None)):
                try:  # spawned ranks too: they share the job's process group
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            rc = "timeout"
    job.result = {"rc": rc, "start": round(start - T0, 1), "seconds": round(time.time() - start, 1), "gpus": gpus,
                  **junit_counts(xml),
                  "times": junit_times(xml, job.step.name)}
    if rc != 0 and not job.result["failed"] and not job.result["errors"]:
        job.result["errors"] = 1  # a crash or timeout that left no test failure behind still fails the step


def junit_times(xml: Path, step: str) -> dict[str, float]:
    """`step:node id` -> seconds of each test case in a job's report."""
    try:
        cases = ET.parse(xml).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        return {}
    out = {}
    for c in cases:
        path = c.get("file") or c.get("classname", "").replace(".", "/") + ".py"
        out[f"{step}:{path}::{c.get('name')}"] = round(float(c.get("time", 0)), 1)
    return out


def junit_counts(xml: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    try:
        suites = ET.parse(xml).getroot().iter("testsuite")
    except (OSError, ET.ParseError):
        return counts
    for s in suites:
        tests, f, e, sk = (int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        counts["failed"] += f
        counts["errors"] += e
        counts["skipped"] += sk
        counts["passed"] += tests - f - e - sk
    return counts


class Pool:
    """Runs jobs on per-GPU slots: `slots` jobs at once on a GPU, of which at most one heavy."""

    def __init__(self, gpus: list[str], slots: int):
        self.free = {g: slots for g in gpus}
        self.heavy = {g: False for g in gpus}
        self.cv = threading.Condition()

    def fits(self, job: Job) -> str | None:
        """The GPU with the most free slots that can take `job` now, or None."""
        ok = [g for g, n in self.free.items() if n > 0 and not (job.heavy and self.heavy[g])]
        return max(ok, key=lambda x: self.free[x]) if ok else None

    def take(self, pending: list[Job]) -> tuple[Job, str]:
        """The first of `pending` (longest first) that some GPU can take now, and that GPU: a heavy job
        waiting for a heavy slot does not hold back the light ones behind it."""
        with self.cv:
            while True:
                for job in pending:
                    g = self.fits(job)
                    if g is not None:
                        pending.remove(job)
                        self.free[g] -= 1
                        self.heavy[g] |= job.heavy
                        return job, g
                self.cv.wait()

    def release(self, g: str, job: Job) -> None:
        with self.cv:
            self.free[g] += 1
            if job.heavy:
                self.heavy[g] = False
            self.cv.notify_all()


def run_pool(jobs: list[Job], gpus: list[str], slots: int, deadline: float, nice: int = 0) -> None:
    pool, threads = Pool(gpus, slots), []
    pending = sorted(jobs, key=lambda j: -j.estimate)
    while pending:
        job, g = pool.take(pending)
        if time.time() > deadline - 5:
            pool.release(g, job)
            job.result = {"rc": "not run", "seconds": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
            continue

        def work(job: Job = job, g: str = g) -> None:
            try:
                run_job(job, [g], deadline, nice)
            finally:
                pool.release(g, job)

        t = threading.Thread(target=work)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


def run_bench(name: str, cmd: list[str], out: Path, limit: float, gpus: list[str]) -> dict:
    start = time.time()
    env = {**os.environ, "PYTHONPATH": pythonpath(), "CUDA_VISIBLE_DEVICES": gpus[0] if gpus else ""}
    log = out / f"{name}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(1.0, limit), check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text(errors="replace")
    log.unlink()  # one benchmarks.log for all (the device machine returns at most 8 files)
    with open(out / "benchmarks.log", "a") as f:
        f.write(f"===== {name}: {' '.join(cmd[1:])}\n{text}\n")
    return {"rc": rc, "seconds": round(time.time() - start, 1), "tail": text.strip().splitlines()[-20:]}


def merge_logs(out: Path, steps: list[str]) -> None:
    """One log per step (the device machine returns at most 8 files): the jobs' logs in order."""
    for name in steps:
        parts = sorted((WORK / "jobs").glob(f"{name}_*.log"))
        with open(out / f"{name}.log", "w") as f:
            f.writelines(f"===== {p.stem}\n{p.read_text(errors='replace')}\n" for p in parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", "580")),
                    help="seconds for the whole run (default 580: one 10-minute device call, with ~20 s of setup "
                    "before it)")
    ap.add_argument("--slots-per-gpu", type=int, default=int(os.environ.get("GPU_CHECK_SLOTS", "8")),
                    help="test processes at once per GPU (kernel tests are compile-bound: CPU work)")
    ap.add_argument("--steps", default="a,b,c,d,e", help="which steps (letters), default all")
    a = ap.parse_args()
    t0 = T0
    deadline = t0 + a.budget
    out = Path(os.environ.get("OUT", "/tmp/out"))
    for d in (out, WORK / "junit", WORK / "jobs"):
        d.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.log").unlink(missing_ok=True)
    gpus = visible_gpus()
    print(f"== {len(gpus)} GPU(s) visible: {','.join(gpus) or '-'}; {os.cpu_count()} CPUs; "
          f"{a.slots_per_gpu} test processes per GPU; budget {a.budget:.0f}s", flush=True)
    if not gpus:
        print("no CUDA GPU visible: nothing to check")
        return 1
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    steps = [s for s in STEPS if s.name[0] in a.steps.split(",")]
    jobs: list[Job] = []
    rows: dict[str, dict] = {s.name: {} for s in steps}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(steps) or 1) as ex:
        collected = dict(zip([s.name for s in steps], ex.map(collect, steps)))
    print(f"== collected in {time.time() - t0:.0f}s: "
          + ", ".join(f"{k} {len(v)} tests" for k, v in collected.items()), flush=True)
    multi = []
    for s in steps:
        if s.gpus > len(gpus):
            rows[s.name] = {"note": f"needs {s.gpus} GPUs, {len(gpus)} visible: not run", "rc": "skip"}
            continue
        if not collected[s.name]:
            rows[s.name] = {"note": "no tests collected", "rc": "none"}
            continue
        (multi if s.gpus > 1 else jobs).extend(make_jobs(s, collected[s.name], known))
    print(f"== {len(jobs)} single-GPU jobs, {len(multi)} multi-GPU jobs", flush=True)
    # The benchmarks run last and alone: the tests leave them BENCH_RESERVE_S of the budget.
    tests_deadline = deadline - (BENCH_RESERVE_S if "e" in a.steps.split(",") else 0)

    # Multi-GPU jobs run beside the pool, each capped, on disjoint sets of MULTI_GPUS GPUs at once (two
    # jobs in parallel on 4 GPUs): one at a time, they outlasted the tests' time on a busy machine.
    queue = sorted(multi, key=lambda j: -j.estimate)  # the longest first
    lock = threading.Lock()

    def run_multi(group: list[str]) -> None:
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop(0)
            run_job(job, group, min(tests_deadline, time.time() + MULTI_JOB_LIMIT_S))

    groups = [gpus[i : i + MULTI_GPUS] for i in range(0, len(gpus) - MULTI_GPUS + 1, MULTI_GPUS)]
    beside = [threading.Thread(target=run_multi, args=(g,)) for g in groups]
    for t in beside:
        t.start()
    run_pool(jobs, gpus, a.slots_per_gpu - (1 if multi else 0), tests_deadline, POOL_NICE if multi else 0)
    for t in beside:
        t.join()
    every = jobs + multi
    times = {k: v for j in every for k, v in j.result.get("times", {}).items()}
    (out / "test_times.json").write_text(json.dumps(times, indent=0, sort_keys=True))
    with open(out / "jobs.tsv", "w") as f:  # when each job ran where: the schedule, to pack the next run
        f.write("start\tseconds\testimate\tgpus\trc\tjob\n")
        for j in sorted(every, key=lambda j: j.result.get("start", 1e9)):
            r = j.result
            f.write(f"{r.get('start', '-')}\t{r.get('seconds', 0)}\t{j.estimate:.0f}\t{','.join(r.get('gpus', []))}\t"
                    f"{r.get('rc')}\t{j.key}\n")
    for j in sorted(every, key=lambda j: -j.result.get("seconds", 0))[:12]:
        print(f"   {j.result.get('seconds', 0):6.1f}s  {j.key}")
    merge_logs(out, [s.name for s in steps])
    for s in steps:
        mine = [j for j in every if j.step is s]
        if not mine:
            continue
        total = {k: sum(j.result.get(k, 0) for j in mine) for k in ("passed", "failed", "errors", "skipped")}
        bad = [j for j in mine if j.result.get("rc") not in (0, 5)]
        none_ran = not total["passed"] and not total["failed"] and not total["errors"]
        rows[s.name] = {**total, "seconds": round(max(j.result.get("seconds", 0) for j in mine), 1),
                        "rc": 0 if not bad and not none_ran else "fail", "jobs": len(mine),
                        "note": "; ".join(f"{j.key.split(':', 1)[1]} rc={j.result.get('rc')}" for j in bad)[:200]}
        if none_ran:
            rows[s.name]["note"] = "every test skipped: nothing was checked"
        for j in bad:
            print(f"   !! {j.key}: rc={j.result.get('rc')} (log: {out}/{s.name}.log)")
    if "e" in a.steps.split(","):
        for name, cmd in BENCHMARKS:
            r = run_bench(name, [sys.executable, *cmd], out, deadline - time.time() - 5, gpus)
            rows[name] = {**r, "note": f"rc={r['rc']}: {r['tail'][-1][:90] if r['tail'] else ''}"}
            print(f"== {name} (tail)\n" + "\n".join(r["tail"][-8:]), flush=True)
    print(f"\n== summary: {time.time() - t0:.0f}s in all, {len(gpus)} GPU(s), logs in {out}")
    print(f"{'step':<16} | {'result':<7} | {'passed':>6} | {'failed':>6} | {'errors':>6} | {'skipped':>7} | "
          f"{'seconds':>7} | note")
    failed = False
    for name, r in rows.items():
        failed |= r.get("rc") not in (0, "skip")
        print(f"{name:<16} | {'PASS' if r.get('rc') == 0 else ('SKIP' if r.get('rc') == 'skip' else 'FAIL'):<7} | "
              f"{r.get('passed', '-'):>6} | {r.get('failed', '-'):>6} | {r.get('errors', '-'):>6} | "
              f"{r.get('skipped', '-'):>7} | {r.get('seconds', '-'):>7} | {r.get('note', '')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
