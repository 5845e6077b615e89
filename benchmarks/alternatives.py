"""The pipeline against what a Lightning user picks instead: DDP, FSDP, FSDP2 (x TP), on the same model and batch.

Every configuration trains the same model with the same global batch (``--global-batch`` samples per optimizer
step over all replicas), AdamW and data, as its own launch of ``--processes`` processes (Lightning's launcher re-runs
this script for the other ranks), one thread each:

- ``ddp``: Lightning's ``DDPStrategy`` (a whole copy per process);
- ``fsdp``: Lightning's ``FSDPStrategy`` (FSDP1). It refuses the CPU (``The strategy `fsdp` requires a GPU
  accelerator``); the refusal is recorded as the result;
- ``fsdp2``: Lightning's ``ModelParallelStrategy``, ``fully_shard`` on every block and the root over all processes;
- ``fsdp2-tp``: the same over ``processes / 2`` replicas, with tensor parallelism over 2 (``parallelize_module``):
  the GPT's MLPs (its fused attention projection does not split by heads), the Llama's attention and MLP;
- ``pipeline``: ``strategy="pipeline"`` at its defaults (one pipeline over all processes, 1F1B);
- ``pipeline-tuned``: the same after ``lightning_pipe.tune`` (schedules, microbatches, stages per rank); the tuning
  itself is not timed;
- ``pipeline-layout``: after ``lightning_pipe.tune`` with the layout searched too (pipeline size 1 included);
- ``pipeline-fsdp``: ``pipeline_size=processes // 2, data_parallel="fsdp"`` (at 2 processes: no pipeline, the
  strategy's FSDP over both).

Two models (``--models``): ``gpt`` (the repository's GPT-2, tests/gpt2.py) and ``llama`` (transformers'
``LlamaForCausalLM`` built from a config; ``--size full`` is 134 M parameters). ``--size tiny`` (the default) is a
smoke run of every code path in seconds; its figures mean nothing.

Per configuration, per run: rank 0's median wall-clock step and every rank's median CPU time per step (after
``--warmup``), each rank's peak resident set (``ru_maxrss``), its parameter, gradient and optimizer-state bytes
(local shards under FSDP), and the bytes it wrote per step (``/proc/self/io`` ``wchar``: gloo's socket writes, which
are the messages it sent, plus any file writes; Linux only). The runs are interleaved: every configuration once, then
again, ``--runs`` times, so a change in the machine's load shows in all of them alike. Results go to
``<out>/alternatives.json`` and a markdown table to ``<out>/alternatives.md``.

Run from the repository root, on a quiet machine, with each process on cores of its own::

    python benchmarks/alternatives.py --size full --processes 2,4 --runs 3 --out benchmarks/results/alternatives
    python benchmarks/alternatives.py            # the smoke: tiny models, 2 processes, one run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

CONFIGS = ("ddp", "fsdp", "fsdp2", "fsdp2-tp", "pipeline", "pipeline-tuned", "pipeline-layout", "pipeline-fsdp")
SIZES = {
    # layers, width, heads, sequence, vocabulary
    "tiny": {"gpt": (4, 64, 4, 32, 256), "llama": (4, 64, 4, 32, 256)},
    # gpt: ~20 M parameters (the first look); llama: ~134 M
    "full": {"gpt": (8, 384, 6, 128, 8192), "llama": (12, 768, 12, 128, 32000)},
}


def build(model: str, size: str) -> torch.nn.Module:
    layers, width, heads, seq, vocab = SIZES[size][model]
    if model == "gpt":
        from tests.gpt2 import GPT2

        return GPT2(vocab=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=int(width * 8 / 3) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


def blocks(network: torch.nn.Module) -> list[torch.nn.Module]:
    return list(network.h) if hasattr(network, "h") else list(network.model.layers)


def tensor_plan(model: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if model == "gpt":
        return {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()})
    return plan


class Bench(L.LightningModule):
    """The model, its loss and data; under ``ModelParallelStrategy`` it shards itself in ``configure_model``."""

    def __init__(self, model: str, size: str, batch_size: int, samples: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.network = build(model, size)

    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        if not isinstance(self.trainer.strategy, ModelParallelStrategy) or getattr(self, "_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = self.device_mesh
        for block in blocks(self.network):
            if mesh["tensor_parallel"].size() > 1:
                parallelize_module(block, mesh["tensor_parallel"], tensor_plan(self.hparams.model))
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.network, mesh=mesh["data_parallel"])
        self._sharded = True

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        if self.hparams.model == "gpt":
            logits = self.network(ids)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return self.network(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        _, _, _, seq, vocab = SIZES[self.hparams.size][self.hparams.model]
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (self.hparams.samples, seq + 1), generator=g)
        labels = tokens[:, :-1] if self.hparams.model == "llama" else tokens[:, 1:]  # transformers shifts itself
        return DataLoader(TensorDataset(tokens[:, :-1], labels), batch_size=self.hparams.batch_size)


def written_bytes() -> int:
    """Bytes this process wrote so far (``/proc/self/io`` ``wchar``), -1 where the OS does not tell."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


class Stamps(L.Callback):
    """Wall, CPU and written bytes at every step's start and at the end of training; state bytes at the end."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.written: list[int] = []
        self.state: dict[str, int] = {}

    def _stamp(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.written.append(written_bytes())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._stamp()

    def on_train_end(self, trainer, pl_module):
        self._stamp()
        from lightning_pipe.measure.memory import state_bytes

        found = state_bytes(pl_module, trainer.optimizers)
        self.state = {"parameters": found.parameters, "gradients": found.gradients, "optimizer": found.optimizer_state}


def replicas(config: str, processes: int) -> int:
    if config in ("ddp", "fsdp", "fsdp2"):
        return processes
    if config in ("fsdp2-tp", "pipeline-fsdp"):
        return max(processes // 2, 1) if config == "fsdp2-tp" else 2 if processes > 2 else processes
    return 1  # one pipeline over every process (the tuned layout sets its own per-replica batch)


def make_strategy(config: str, processes: int):
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    import lightning_pipe

    if config == "ddp":
        return DDPStrategy()
    if config == "fsdp":
        return FSDPStrategy()
    if config == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=processes, tensor_parallel_size=1)
    if config == "fsdp2-tp":
        return ModelParallelStrategy(data_parallel_size=max(processes // 2, 1), tensor_parallel_size=2)
    if config == "pipeline-fsdp":
        return lightning_pipe.PipelineParallelStrategy(
            pipeline_size=processes // replicas(config, processes), data_parallel="fsdp"
        )
    return lightning_pipe.PipelineParallelStrategy()


def worker(args: argparse.Namespace) -> None:
    import lightning_pipe
    from benchmarks.common import pin_to_core

    # Rank 0 is this process (LOCAL_RANK unset until Lightning's launcher sets it); ranks 1..N-1 are its re-runs,
    # which inherit rank 0's core and pin themselves again. With more processes than cores they share cyclically.
    core = None if args.no_pin else pin_to_core(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(1)
    L.seed_everything(0)
    batch = args.global_batch // replicas(args.config, args.processes)
    model = Bench(args.model, args.size, batch, samples=args.global_batch * (args.steps + 8))
    stamps = Stamps()
    trainer = L.Trainer(
        strategy=make_strategy(args.config, args.processes),
        accelerator="cpu",
        devices=args.processes,
        max_steps=args.warmup + args.steps,
        callbacks=[stamps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    chosen = None
    if args.config in ("pipeline-tuned", "pipeline-layout"):
        space = lightning_pipe.SearchSpace(
            schedules=("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
            activation_checkpointing=(0,),
            **(
                {"pipeline_sizes": "auto", "data_parallel": ("ddp", "fsdp")} if args.config == "pipeline-layout" else {}
            ),
        )
        found = lightning_pipe.tune(trainer, model, space=space, steps=3, warmup_steps=1, max_trials=args.trials)
        chosen = found.choice.label
    trainer.fit(model)
    settings = getattr(trainer.strategy, "settings", None)
    result = {
        "wall": stamps.wall,
        "cpu": stamps.cpu,
        "written": stamps.written,
        "state": stamps.state,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "chosen": chosen,
        "pinned": core is not None,
        "layout": None
        if settings is None
        else f"pp={settings.pipeline_size} dp={settings.data_parallel_size} {settings.data_parallel}"
        f" {settings.schedule} M={settings.microbatches}",
        "parameters": sum(p.numel() for p in build(args.model, args.size).parameters())
        if trainer.global_rank == 0
        else 0,
    }
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _median_after(stamps: list[float], warmup: int) -> float:
    periods = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    return statistics.median(periods)


def last_error(stderr: str) -> str:
    """The last exception line of a failed launch (``SomethingError: message``), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^(\[rank\d+\]: )?[\w.]+(Error|Exception): ", line)]
    return ((raised or lines or ["no output"])[-1])[:400]


def launch(args: argparse.Namespace, config: str, processes: int, model: str) -> dict:
    """One configuration's run: its figures, or the error that stopped it."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", "--config", config, "--model", model, "--out", out]
        cmd += [f"--processes={processes}", f"--size={args.size}", f"--global-batch={args.global_batch}"]
        cmd += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--trials={args.trials}"]
        cmd += ["--no-pin"] if args.no_pin else []
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != processes:
        return {"error": last_error(proc.stderr)}
    written = [
        (r["written"][-1] - r["written"][args.warmup]) / args.steps if r["written"][0] >= 0 else None for r in ranks
    ]
    return {
        "step_s": _median_after(ranks[0]["wall"], args.warmup),
        "cpu_s": [_median_after(r["cpu"], args.warmup) for r in ranks],
        "peak_rss": [r["peak_rss"] for r in ranks],
        "state": [sum(r["state"].values()) for r in ranks],
        "written_per_step": written,
        "chosen": ranks[0]["chosen"],
        "layout": ranks[0]["layout"],
        "parameters": ranks[0]["parameters"],
    }


def markdown(results: dict) -> str:
    from lightning_pipe.measure.memory import format_bytes

    lines = []
    for key, runs in results["configs"].items():
        model, processes, config = key.split("/")
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {model} | {processes} | {config} | refused or failed: {runs[0]['error']} | | | | |")
            continue
        steps = sorted(r["step_s"] for r in ok)
        med = statistics.median
        cpu = med(sum(r["cpu_s"]) for r in ok)
        rss = med(max(r["peak_rss"]) for r in ok)
        state = med(max(r["state"]) for r in ok)
        sent = [
            max(w for w in r["written_per_step"] if w is not None) for r in ok if r["written_per_step"][0] is not None
        ]
        note = ok[0]["chosen"] or ok[0]["layout"] or ""
        lines.append(
            f"| {model} | {processes} | {config} | {med(steps) * 1e3:.1f} ({steps[0] * 1e3:.1f}-{steps[-1] * 1e3:.1f})"
            f" | {cpu * 1e3:.1f} | {format_bytes(rss)} | {format_bytes(state)} |"
            f" {format_bytes(med(sent)) if sent else '-'} | {note} |"
        )
    head = (
        "| model | processes | configuration | step ms, rank 0 (median of runs; min-max) | CPU ms per step, all"
        " ranks | peak RSS, largest rank | parameters + gradients + optimizer state, largest rank | bytes written"
        " per step, largest rank | layout / tuned choice |\n|---|---|---|---|---|---|---|---|---|"
    )
    return head + "\n" + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--processes", default="2", help="comma-separated process counts, e.g. 2,4")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step, all replicas")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--trials", type=int, default=4, help="the tuned configurations' max_trials")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--out", default="benchmarks/results/alternatives")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave the processes free to run on every core (default: one core each)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.processes = int(args.processes)
        worker(args)
        return
    from benchmarks.common import machine

    results: dict = {"machine": machine(), "arguments": vars(args), "configs": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(args.runs):
        for processes in (int(p) for p in args.processes.split(",")):
            for model in args.models.split(","):
                for config in args.configs.split(","):
                    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
                    found = {**launch(args, config, processes, model), "load_at_start": load}
                    results["configs"].setdefault(f"{model}/{processes}/{config}", []).append(found)
                    print(f"{model} x{processes} {config}: {json.dumps(found)[:200]}", file=sys.stderr)
                    # Written after every launch, so that a long run stopped early keeps what it measured.
                    (out / "alternatives.json").write_text(json.dumps(results, indent=1))
                    (out / "alternatives.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
