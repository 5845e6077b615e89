"""Per-rank memory while a pipeline starts from a Hugging Face directory, and while ``export-hf`` writes one.

A Llama of 321 MiB of float32 weights (hidden 512, 16 layers, vocabulary 32000, untied head) is saved with
``save_pretrained(max_shard_size="100MB")`` (4 shards). For each pipeline size, a Trainer with
``PipelineParallelStrategy(init_weights=<directory>)`` builds the network from the directory's config in
``configure_model`` (meta device) and each rank loads its stages; a callback reads the rank's resident set from
before ``configure_model`` to the start of training (construction, initialisation and load), and the strategy's
memory report gives the load alone. The run's checkpoint is then exported in a fresh process and its peak measured.

Figures (Linux ``VmHWM``, reset at the start of each measured block; tensor bytes from
:class:`lightning_pipe.measure.memory.PeakMemory`):

- ``own``: the rank's parameters and buffers;
- ``start``: resident set growth from before ``configure_model`` to the first batch (construction + load);
- ``load``: resident set growth while ``init_weights`` was read into the allocated stages;
- export: resident set growth and tensor bytes allocated at most, against the largest shard and the largest tensor
  (the runtime's import of transformers is made before the measurement).

Run from the repository root (about 2 minutes on 2 cores)::

    python benchmarks/hf_checkpoint.py               # --stages 2 4 --work /tmp/hf-checkpoint-bench
    python benchmarks/hf_checkpoint.py --quick       # a tiny model: the same code paths in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import proc_status_bytes  # noqa: E402
from lightning_pipe.measure.memory import format_bytes  # noqa: E402

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=16, num_attention_heads=8, vocab_size=32000)
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, vocab_size=1000)
SHARD = {"full": "100MB", "quick": "100KB"}


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set restarts from the current one
    return proc_status_bytes("VmRSS")


def prepare(work: Path, quick: bool) -> None:
    import transformers

    config = transformers.LlamaConfig(
        **(QUICK if quick else MODEL), max_position_embeddings=256, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(work / "hf", max_shard_size=SHARD["quick" if quick else "full"])


def load_worker(work: Path, stages: int) -> None:
    """One rank of a pipeline started from the directory (Lightning starts the others by re-running this command)."""
    import lightning.pytorch as L
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe import PipelineParallelStrategy
    from lightning_pipe.measure.memory import state_bytes

    vocab = transformers.AutoConfig.from_pretrained(work / "hf").vocab_size

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                config = transformers.AutoConfig.from_pretrained(work / "hf")
                self.model = transformers.AutoModelForCausalLM.from_config(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randint(0, vocab, (2 * stages, 8))), batch_size=2 * stages)

    class Probe(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:  # before configure_model and the strategy's setup
            self.base = _reset_peak()

        def on_fit_start(self, trainer, pl_module) -> None:
            peak = trainer.strategy.memory_report.load_peak
            result = {
                "rank": trainer.global_rank,
                "own": state_bytes(trainer.strategy.model).parameters,
                "start": proc_status_bytes("VmHWM") - self.base,
                "load": peak.rss_bytes,
                "load_tensors": peak.bytes,
            }
            (work / f"load-{stages}.rank{trainer.global_rank}.json").write_text(json.dumps(result))

    trainer = L.Trainer(
        accelerator="cpu",
        devices=stages,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=PipelineParallelStrategy(schedule="1F1B", init_weights=work / "hf"),
        callbacks=[Probe()],
    )
    trainer.fit(FineTune())
    trainer.save_checkpoint(work / f"ckpt-{stages}", weights_only=True)


def export_worker(work: Path, stages: int, quick: bool) -> None:
    import transformers  # noqa: F401  (imported before the measurement: the runtime, not the export)

    from lightning_pipe.checkpoint import export
    from lightning_pipe.measure.memory import PeakMemory
    from lightning_pipe.models.huggingface import export as hf_export

    out = work / f"export-{stages}"
    with PeakMemory("cpu") as peak:
        export.export(work / f"ckpt-{stages}", out, max_shard_size=SHARD["quick" if quick else "full"])
    shards = [p.stat().st_size for p in out.glob("*.safetensors")]
    index = json.loads((out / hf_export.INDEX).read_text()) if len(shards) > 1 else None
    from safetensors import safe_open

    largest = 0
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            largest = max([largest, *(f.get_tensor(name).nbytes for name in f.keys())])
    assert index is None or index["metadata"]["total_size"] <= sum(shards)
    result = {"rss": peak.rss_bytes, "tensors": peak.bytes, "largest_shard": max(shards), "largest_tensor": largest}
    (work / f"export-{stages}.json").write_text(json.dumps({**result, "shards": len(shards)}))


def _run(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, __file__, *args], cwd=ROOT, env=env, check=True)


def report(work: Path, stages: list[int]) -> str:
    lines = [
        "| stages | rank | own parameters | start (construction + load) | load | start / own |",
        "|---|---|---|---|---|---|",
    ]
    for n in stages:
        for r in range(n):
            rank = json.loads((work / f"load-{n}.rank{r}.json").read_text())
            cells = [format_bytes(rank[k]) for k in ("own", "start", "load")]
            lines.append(f"| {n} | {r} | {' | '.join(cells)} | {rank['start'] / rank['own']:.2f} |")
    lines += ["", "| checkpoint of | shards | largest shard | largest tensor | export peak (resident) | tensors |"]
    lines.append("|---|---|---|---|---|---|")
    for n in stages:
        e = json.loads((work / f"export-{n}.json").read_text())
        cells = [format_bytes(e[k]) for k in ("largest_shard", "largest_tensor", "rss", "tensors")]
        lines.append(f"| {n} stages | {e['shards']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf-checkpoint-bench"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=["load", "export"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "load":
        return load_worker(args.work, args.stages[0])
    if args.worker == "export":
        return export_worker(args.work, args.stages[0], args.quick)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    prepare(args.work, args.quick)
    quick = ["--quick"] if args.quick else []
    for n in args.stages:
        _run(["--worker", "load", "--work", str(args.work), "--stages", str(n), *quick])
        _run(["--worker", "export", "--work", str(args.work), "--stages", str(n), *quick])
    table = report(args.work, args.stages)
    print(table)
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    results = {
        n: {
            "ranks": [json.loads((args.work / f"load-{n}.rank{r}.json").read_text()) for r in range(n)],
            "export": json.loads((args.work / f"export-{n}.json").read_text()),
        }
        for n in args.stages
    }
    if not args.quick:
        (ROOT / "benchmarks" / "results" / "hf_checkpoint.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
