"""CorePool: the frontend's engine-core replicas (data parallelism, `--data-parallel-size N`): one
`CoreProcess` per replica from one `CoreSpec` (only the device differs), which replica owns each request,
and least-loaded routing. N = 1 is the plain single-core server."""

from __future__ import annotations

import time
from collections.abc import Callable

from swaserve.core.engine_core import CoreSpec
from swaserve.core.messages import Ready, ToCore
from swaserve.core.process import CoreProcess, CoreStartupError


def visible_gpus() -> int:
    """CUDA devices this process can see (0 without CUDA). Asked only for N > 1 replicas on CUDA, so
    that too many replicas fail here, before any core starts, with the reason."""
    import torch

    return torch.cuda.device_count()


def replica_specs(spec: CoreSpec, n: int, gpu_count: Callable[[], int] = visible_gpus) -> list[CoreSpec]:
    """The `CoreSpec` of each of `n` replicas. On CUDA replica i starts on the GPU after replica i-1's:
    `cuda:{k + i * tp}` for a device `cuda:k` (`cuda`: k = 0), where a replica takes tp GPUs
    (`tensor_parallel_size`, 1 without tensor parallelism); on CPU every replica gets "cpu". A spec
    without a `device` keyword (a test's fake engine) and a single replica are used as they are.
    Raises ValueError for n < 1, more GPUs than are visible, and (n > 1) several nodes, whose
    rendezvous replicas cannot share yet."""
    if n < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {n}")
    if n == 1:
        return [spec]
    kw = spec.kwargs
    if (kw.get("nnodes") or 1) > 1 or kw.get("dist_init_addr"):
        raise ValueError("--data-parallel-size > 1 does not combine with --nnodes > 1 or --dist-init-addr "
                         "yet (every replica would meet at the same rendezvous)")
    if "device" not in kw:
        return [spec] * n
    device = kw["device"]
    if device is None:  # the engine's default: CUDA when there is a GPU
        device = "cuda" if gpu_count() > 0 else "cpu"
    kind, _, index = str(device).partition(":")
    if kind != "cuda":
        return [CoreSpec(spec.factory, {**kw, "device": device})] * n
    if index and not index.isdigit():
        raise ValueError(f"invalid device {device!r}")
    first, count = int(index or 0), gpu_count()
    tp = int(kw.get("tensor_parallel_size") or 1)  # a replica's ranks: cuda:{its first} .. (`rank_device`)
    if first + n * tp > count:
        raise ValueError(
            f"--data-parallel-size {n} on device {device!r} needs GPUs cuda:{first}.."
            f"cuda:{first + n * tp - 1} ({tp} per replica), but {count} GPU(s) are visible")
    return [CoreSpec(spec.factory, {**kw, "device": f"cuda:{first + i * tp}"}) for i in range(n)]


class CorePool:
    """N engine cores behind one frontend, and where each open request went.

    Invariants: `in_flight[i]` is the number of sub-requests added on replica i and not yet `done()`
    (exactly the ones the frontend tracks there); every sub-request of one user request is opened on the
    same replica (`pick()` once, then `add()` each); inputs about a request (its abort) go to its replica.
    """

    def __init__(self, specs: list[CoreSpec], endpoints: list[tuple[str, str]] | None = None):
        """`endpoints`: (input, output) addresses per replica of cores another process starts (this
        frontend is one of several, `--api-server-count`); None: this pool starts its cores."""
        assert specs, "at least one replica"
        assert endpoints is None or len(endpoints) == len(specs)
        self.cores = [CoreProcess(spec, endpoints[i] if endpoints is not None else None)
                      for i, spec in enumerate(specs)]
        self.in_flight = [0] * len(specs)

    def __len__(self) -> int:
        return len(self.cores)

    @property
    def pids(self) -> list[int | None]:
        return [core.pid for core in self.cores]

    def start(self, timeout: float = 1800.0) -> Ready:
        """Start every core (they load in parallel) and wait until all are ready; on any failure kill
        them all and raise it (ValueError: bad input; CoreStartupError: anything else)."""
        ready: dict[int, Ready] = {}
        deadline = time.monotonic() + timeout
        try:
            for core in self.cores:
                if not core.attached:
                    core.launch()
            while len(ready) < len(self.cores):
                for i, core in enumerate(self.cores):
                    if i not in ready and (msg := core.poll_ready(20)) is not None:
                        ready[i] = msg
                if len(ready) < len(self.cores) and time.monotonic() > deadline:
                    raise CoreStartupError(f"the engine cores were not ready within {timeout:.0f} s")
        except BaseException:
            self.kill()
            raise
        models = {(r.model_name, r.max_context) for r in ready.values()}
        if len(models) > 1:
            self.kill()
            raise CoreStartupError(f"the replicas disagree on the model (name, context): {sorted(models)}")
        return ready[0]

    # ---- routing -----------------------------------------------------------------------------------

    def pick(self) -> int:
        """The replica for a new user request: fewest sub-requests in flight, ties to the lowest index."""
        counts = self.in_flight
        return min(range(len(counts)), key=counts.__getitem__)

    def add(self, replica: int, msg: ToCore) -> None:
        """Send a new sub-request (its `AddRequest`) to `replica` and count it in flight there."""
        self.in_flight[replica] += 1
        self.cores[replica].send(msg)

    def done(self, replica: int) -> None:
        """A sub-request on `replica` left the frontend (finished, aborted, refused or failed)."""
        self.in_flight[replica] -= 1
        assert self.in_flight[replica] >= 0

    def send(self, replica: int, msg: ToCore) -> None:
        self.cores[replica].send(msg)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """Ask every core to exit, then wait for each until `timeout` s in total have passed (killing
        the ones still running) and release their sockets."""
        deadline = time.monotonic() + timeout
        for core in self.cores:
            core.request_stop()
        for core in self.cores:
            core.stop(deadline - time.monotonic())

    def kill(self) -> None:
        for core in self.cores:
            core.kill()
            core.close()
