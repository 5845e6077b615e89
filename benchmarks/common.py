"""What every benchmark run shares: the models, the data, the clock and the description of the machine.

Two networks, both an ``nn.Sequential`` of ``depth`` blocks ``Linear(width, width) + ReLU`` trained with an MSE loss
and SGD, so the hand-written loop and the strategy split them identically (``depth / stages`` blocks per stage):

- ``compute``: width 1024, 8 blocks, batch 512: each step is ~24 GFLOP, the fixed costs of a step vanish in it;
- ``small``: width 256, 4 blocks, batch 64: a step is a few milliseconds, so the fixed per-step cost shows.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    width: int
    depth: int
    batch: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


MODELS = {
    "compute": ModelSpec("compute", width=1024, depth=8, batch=512),
    "small": ModelSpec("small", width=256, depth=4, batch=64),
    # the layout tuning's workloads (benchmarks/tune.py --layouts): few wide layers on few samples, whose gradients
    # are large against their compute; many narrow layers
    "wide": ModelSpec("wide", width=2048, depth=6, batch=16),
    "deep": ModelSpec("deep", width=64, depth=16, batch=32),
    # --quick: the same code paths in a fraction of a second
    "tiny": ModelSpec("tiny", width=32, depth=8, batch=32),
}
LR = 1e-3


def make_network(spec: ModelSpec) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(spec.width, spec.width), nn.ReLU()) for _ in range(spec.depth)])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def dataset(spec: ModelSpec, batches: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * spec.batch, spec.width, generator=g)
    y = torch.randn(batches * spec.batch, spec.width, generator=g)
    return TensorDataset(x, y)


def loader(data: TensorDataset, batch: int) -> DataLoader:
    """The data path of every run: one in-process DataLoader, no shuffling, no workers."""
    return DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)


# ---------------------------------------------------------------------------------------------------- device and clock
def device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def check_devices(nprocs: int) -> None:
    """Before a launch of ``nprocs`` processes: where torch sees GPUs, every process takes one of its own
    (:func:`device_for`; NCCL refuses two ranks on one GPU), so a machine with fewer GPUs than processes is refused
    here, with the fix, instead of each extra rank failing on a device ordinal it does not have."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < nprocs:
        raise SystemExit(
            f"benchmarks: a {nprocs}-process launch puts each process on a GPU of its own (cuda:0 to"
            f" cuda:{nprocs - 1}), and torch sees {gpus} GPU{'s' if gpus > 1 else ''} here. Measure on the CPUs"
            " (gloo) with CUDA_VISIBLE_DEVICES= set empty, or run on a machine with at least"
            f" {nprocs} GPUs."
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    nprocs: int, cases: list[dict[str, Any]], out: Path, timeout: float, env_extra: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run ``cases`` in one ``torch.distributed.run`` launch of ``nprocs`` processes (``env_extra``: more variables for
    them); their records."""
    check_devices(nprocs)
    cases_file, results_file = out / f"cases-{nprocs}.json", out / f"results-{nprocs}.jsonl"
    log_file = out / f"worker-{nprocs}.log"
    cases_file.write_text(json.dumps(cases))
    results_file.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.update(env_extra or {})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", f"--master-port={free_port()}"]
    cmd += [str(ROOT / "benchmarks" / "worker.py"), str(cases_file), str(results_file)]
    start = time.perf_counter()
    with log_file.open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    print(f"  {nprocs} process(es), {len(cases)} cases: {time.perf_counter() - start:.0f} s", flush=True)
    if proc.returncode != 0:
        tail = log_file.read_text()[-4000:]
        raise SystemExit(f"The {nprocs}-process launch failed (exit {proc.returncode}); {log_file}:\n{tail}")
    return [json.loads(line) for line in results_file.read_text().splitlines()]


class Clock:
    """Stamps taken at the start of every step and once after the last: wall-clock time and this process's CPU time
    (user + system, all its threads), in ns. On a GPU a stamp waits for the queued work first.

    CPU time is what a step's fixed costs (Python, pickling, collectives) consume; unlike wall-clock time it barely
    changes when other processes compete for the cores (gloo waits for messages without spinning).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wall: list[int] = []
        self.cpu: list[int] = []

    def tick(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.wall.append(time.perf_counter_ns())
        self.cpu.append(time.process_time_ns())


def periods_ms(stamps: list[int], warmup: int) -> list[float]:
    """Step times from the stamps taken at the start of each step (and one after the last), warm-up steps dropped."""
    times = [(b - a) / 1e6 for a, b in zip(stamps, stamps[1:])]
    return times[warmup:]


# ---------------------------------------------------------------------------------------------------- environment
def proc_status_bytes(field: str) -> int:
    """A size from Linux's ``/proc/self/status`` in bytes (``VmRSS``: the resident set now; ``VmHWM``: its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def pin_to_core(index: int) -> int | None:
    """Pin every thread of this process to one core of those it may use (the ``index``-th, cyclically); the core,
    or ``None`` where the OS does not support it. Left unpinned, two pipeline processes on two cores measured the
    same setting up to 1.45x apart from one Trainer to the next (the OS moves their compute and communication
    threads between the cores); pinned, 12-16% faster and mostly steadier (docs/tuning.md)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[index % len(allowed)]
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), {core})
    return core


def machine() -> dict[str, Any]:
    """The machine and software every figure was measured with."""
    import lightning

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "platform": platform.platform(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
