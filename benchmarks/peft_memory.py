"""Per-rank memory and step time of a LoRA fine-tune of a 0.5 B model at 2 pipeline stages, against one process and
against the full fine-tune.

A Qwen2 causal LM with the shapes of Qwen2-0.5B (hidden 896, 24 layers, 14 heads / 2 key-value heads, intermediate
4864, vocabulary 151,936, tied embedding: 494 M parameters), random weights, is saved with
``save_pretrained(max_shard_size="500MB")`` (several shards). Each configuration runs in fresh processes, one at a
time: AdamW (lr 1e-4), batch 4 x 64 tokens, ``--steps`` steps (default 4).

- ``lora`` / ``full`` at 2 stages: ``PipelineParallelStrategy(schedule="1F1B", init_weights=<directory>)``, the network
  built from the directory's config in ``configure_model`` (meta device), ``get_peft_model(model, LoraConfig(r=8,
  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))`` for ``lora``;
- ``lora`` / ``full`` at 1 process: a plain Lightning Trainer (no pipeline), ``from_pretrained`` (+ ``get_peft_model``).

Per rank: the peak resident set of the process (Linux ``VmHWM``, whole run: imports, construction, load, steps), the
parameters it holds and the median step time after the first step. Measured and asserted at every optimizer step
(``on_before_optimizer_step``): every frozen parameter has no ``.grad`` and the optimizer holds state for the
trainable parameters only (``frozen with grad``, ``state tensors``).

Run from the repository root (several minutes on 2 cores; the full fine-tune needs about 11 GiB for one process and
15 GiB for two ranks)::

    python benchmarks/peft_memory.py                       # lora-2 lora-1 full-2 full-1
    python benchmarks/peft_memory.py --runs lora-2 lora-1  # the LoRA figures only
    python benchmarks/peft_memory.py --quick               # a tiny Qwen2: the same code paths in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import proc_status_bytes  # noqa: E402
from lightning_pipe.measure.memory import format_bytes  # noqa: E402

MODEL = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
)
QUICK = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=1000,
)  # fmt: skip
SHARD = {"full": "500MB", "quick": "100KB"}
BATCH, TOKENS = 4, 64
RUNS = ("lora-2", "lora-1", "full-2", "full-1")


def prepare(work: Path, quick: bool) -> None:
    import transformers

    config = transformers.Qwen2Config(
        **(QUICK if quick else MODEL), max_position_embeddings=512, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(work / "hf", max_shard_size=SHARD["quick" if quick else "full"])


class Probe(L.Callback):
    """Step times, the frozen parameters' gradients and optimizer state at every step, the peak resident set."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.times: list[float] = []
        self.checks: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self.start)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = list(trainer.strategy.model.parameters())
        frozen = [p for p in params if not p.requires_grad]
        state = optimizer.state
        self.checks.append(
            {
                "frozen_with_grad": sum(p.grad is not None for p in frozen),
                "frozen_with_state": sum(p in state for p in frozen),
                "trainable_without_grad": sum(p.grad is None for p in params if p.requires_grad),
            }
        )

    def on_train_end(self, trainer, pl_module) -> None:
        params = list(trainer.strategy.model.parameters())
        state = trainer.optimizers[0].state
        result = {
            "rank": trainer.global_rank,
            "peak_rss": proc_status_bytes("VmHWM"),
            "params": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "state_tensors": sum(1 for s in state.values() for v in s.values() if torch.is_tensor(v)),
            "state_bytes": sum(v.nbytes for s in state.values() for v in s.values() if torch.is_tensor(v)),
            "step_s": statistics.median(self.times[1:] or self.times),
            "checks": self.checks,
        }
        Path(f"{self.out}rank{trainer.global_rank}.json").write_text(json.dumps(result))


def worker(work: Path, tuning: str, procs: int, steps: int) -> None:
    """One rank of a configuration (Lightning starts the other rank by re-running this command)."""
    import peft
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineParallelStrategy

    directory = work / "hf"
    vocab = transformers.AutoConfig.from_pretrained(directory).vocab_size

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            if procs == 1:
                model = transformers.AutoModelForCausalLM.from_pretrained(directory)
            else:
                config = transformers.AutoConfig.from_pretrained(directory)
                model = transformers.AutoModelForCausalLM.from_config(config)
            if tuning == "lora":
                config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
                model = peft.get_peft_model(model, config)
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

        def train_dataloader(self):
            ids = torch.randint(0, vocab, (BATCH * steps, TOKENS), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(ids), batch_size=BATCH)

    kwargs = {}
    if procs > 1:
        kwargs["strategy"] = PipelineParallelStrategy(schedule="1F1B", init_weights=directory)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=procs,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe(work / f"{tuning}-{procs}.")],
        **kwargs,
    )
    trainer.fit(FineTune())


def _run(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=env, check=True)


def results(work: Path, run: str) -> list[dict]:
    tuning, procs = run.split("-")
    ranks = [json.loads((work / f"{tuning}-{procs}.rank{r}.json").read_text()) for r in range(int(procs))]
    for rank in ranks:  # the frozen base carries no gradient and no optimizer state
        assert rank["checks"], run
        for check in rank["checks"]:
            assert check["frozen_with_grad"] == 0 and check["frozen_with_state"] == 0, (run, check)
            assert check["trainable_without_grad"] == 0, (run, check)
    return ranks


def report(work: Path, runs: list[str]) -> str:
    lines = [
        "| run | rank | parameters held | trainable | optimizer state | frozen with grad / state | peak resident |"
        " step time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        tuning, procs = run.split("-")
        where = "2 stages" if procs == "2" else "1 process"
        for r in results(work, run):
            grads, states = (max(c[k] for c in r["checks"]) for k in ("frozen_with_grad", "frozen_with_state"))
            frozen = f"{grads} / {states}"
            cells = [
                f"{tuning} {where}",
                str(r["rank"]),
                f"{r['params'] / 1e6:.1f} M",
                f"{r['trainable'] / 1e6:.2f} M",
                f"{r['state_tensors']} tensors, {format_bytes(r['state_bytes'])}",
                frozen,
                format_bytes(r["peak_rss"]),
                f"{r['step_s']:.2f} s",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/peft-memory-bench"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep", action="store_true", help="reuse the saved model directory of an earlier run")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.work, args.worker[0], int(args.worker[1]), args.steps)
    if not (args.keep and (args.work / "hf").is_dir()):
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        prepare(args.work, args.quick)
    for run in args.runs:
        tuning, procs = run.split("-")
        _run(["--worker", tuning, procs, "--work", str(args.work), "--steps", str(args.steps)])
    table = report(args.work, args.runs)
    print(f"load average at the end: {os.getloadavg()}")
    print(table)
    if not args.quick:
        (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
        found = {run: results(args.work, run) for run in args.runs}
        (ROOT / "benchmarks" / "results" / "peft_memory.json").write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
