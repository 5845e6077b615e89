"""Smoke tests of the examples: each one's ``train.py`` runs its own ``config.yaml`` for a few steps on 2 processes.

They run the README's command with a handful of overrides (fewer steps, logs under ``tmp_path``), as a user would.
Validation and checkpointing run as configured.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from tests.launch import ROOT, clean_env, launch

# Starts processes: left out of the fast tier (`pytest -m 'not slow'`).
pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples"


def run_example(script: Path, *args: str, launcher: str = "lightning", timeout: float = 300) -> str:
    """Run an example script as its README says (plain python, or torchrun) and return its output."""
    env = clean_env()

    def command(port: str) -> list[str]:
        if launcher == "torchrun":
            run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}"]
            return [*run, str(script), *args]
        return [sys.executable, str(script), *args]

    proc = launch(command, env, timeout)
    if proc.returncode != 0:
        pytest.fail(f"{script.name} {args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout + proc.stderr


def fit_args(name: str, tmp_path: Path, *overrides: str) -> list[str]:
    config = EXAMPLES / name / "config.yaml"
    args = [
        "fit",
        "--config",
        str(config),
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        *overrides,
    ]
    return args


def logged(tmp_path: Path) -> dict[str, list[float]]:
    """Every metric of the run's CSVLogger file, in logging order."""
    files = list(tmp_path.rglob("metrics.csv"))
    assert len(files) == 1, files
    out: dict[str, list[float]] = {}
    with files[0].open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None):
                    out.setdefault(key, []).append(float(value))
    return out


def test_gpt_example(tmp_path: Path) -> None:
    run_example(
        EXAMPLES / "gpt" / "train.py",
        *fit_args(
            "gpt",
            tmp_path,
            "--trainer.max_steps=8",
            "--trainer.val_check_interval=4",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=2",
            "--model.warmup_steps=2",
        ),
    )
    metrics = logged(tmp_path)
    assert len(metrics["train_loss"]) == 4
    assert all(math.isfinite(v) for v in metrics["train_loss"])
    # byte-level model: an untrained one is near ln(256) = 5.5; a few AdamW steps already move it down
    assert metrics["train_loss"][-1] < 5.5
    # Perplexity's per-step value covers the whole batch (its states are summed over microbatches), so it is the
    # exponential of the batch's mean loss, not of the last microbatch's.
    assert len(metrics["train_ppl"]) == 4
    assert metrics["train_ppl"] == pytest.approx([math.exp(v) for v in metrics["train_loss"]], rel=1e-4)
    assert len(metrics["val_ppl"]) == 2
    assert metrics["val_ppl"][-1] == pytest.approx(math.exp(metrics["val_loss"][-1]), rel=0.05)


def test_cnn_example(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")  # the digits ship with scikit-learn (the `examples` extra)
    run_example(
        EXAMPLES / "cnn" / "train.py",
        *fit_args(
            "cnn",
            tmp_path,
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=12",
            "--trainer.limit_val_batches=3",
            "--trainer.log_every_n_steps=4",
            "--model.norm=batch",
        ),
    )
    metrics = logged(tmp_path)
    assert len(metrics["train_loss"]) == 3
    assert all(math.isfinite(v) for v in metrics["train_loss"])
    assert 0.0 <= metrics["train_acc"][-1] <= 1.0
    # With `norm=batch` (ResNet's BatchNorm): its running statistics on the second stage must survive torch's shape
    # inference (no NaN), and
    # 12 steps already beat chance (0.1) on held-out digits.
    assert math.isfinite(metrics["val_loss"][-1])
    assert 0.3 < metrics["val_acc"][-1] <= 1.0


@pytest.mark.slow
def test_cnn_example_as_configured_trains_as_one_device(tmp_path: Path) -> None:
    """The README's first command's network (GroupNorm, the default) under the config's microbatching: the same
    losses as one device (one process here, the config's 4 microbatches; the 2-stage split is exact by
    construction, tests/test_parity.py)."""
    pytest.importorskip("sklearn")
    import importlib.util

    import lightning.pytorch as L

    import lightning_pipe
    from tests.models import quiet_trainer

    spec = importlib.util.spec_from_file_location("cnn_train", EXAMPLES / "cnn" / "train.py")
    cnn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cnn)

    def losses(strategy) -> list[float]:
        L.seed_everything(0)
        model, data = cnn.DigitsClassifier(), cnn.Digits(batch_size=32)
        seen: list[float] = []
        model.on_train_batch_end = lambda outputs, batch, batch_idx: seen.append(float(outputs["loss"]))
        kwargs = {"strategy": strategy} if strategy is not None else {}
        trainer = quiet_trainer(devices=1, max_epochs=1, limit_train_batches=4, limit_val_batches=0, **kwargs)
        trainer.fit(model, datamodule=data)
        return seen

    pipelined = losses(lightning_pipe.PipelineParallelStrategy(schedule="GPipe", microbatches=4))
    torch_losses = losses(None)
    assert len(pipelined) == 4
    assert pipelined == pytest.approx(torch_losses, rel=1e-5)


@pytest.mark.extended
def test_cnn_example_alexnet(tmp_path: Path) -> None:
    # The AlexNet layout splits between the convolutional features and the classifier (seed 002's split).
    pytest.importorskip("sklearn")
    run_example(
        EXAMPLES / "cnn" / "train.py",
        *fit_args(
            "cnn",
            tmp_path,
            "--model.arch=alexnet",
            "--trainer.strategy.init_args.split_points=[flatten]",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=4",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=2",
        ),
    )
    assert len(logged(tmp_path)["train_loss"]) == 2


@pytest.mark.extended
def test_migrate_before_and_after_match(tmp_path: Path) -> None:
    """The hand-written loop and the strategy train the same model to the same losses, step for step."""
    steps = 6
    before = tmp_path / "before.json"
    run_example(
        EXAMPLES / "migrate" / "before.py",
        "--steps",
        str(steps),
        "--losses",
        str(before),
        "--checkpoint",
        str(tmp_path / "dcp"),
        launcher="torchrun",
    )
    after_dir = tmp_path / "after"
    run_example(
        EXAMPLES / "migrate" / "train.py",
        *fit_args("migrate", after_dir, f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0"),
    )
    expected = json.loads(before.read_text())
    got = logged(after_dir)["train_loss"]
    assert len(expected) == len(got) == steps
    assert got == pytest.approx(expected, rel=1e-4)
    assert expected[-1] < expected[0]
    assert (tmp_path / "dcp" / ".metadata").exists()


@pytest.mark.extended
def test_hf_finetune_example(tmp_path: Path) -> None:
    """The README's four commands: a pretrained directory, fine-tuned from it, exported, read by from_pretrained."""
    pytest.importorskip("transformers")
    example = EXAMPLES / "hf_finetune"
    pretrained = tmp_path / "pretrained"
    run_example(example / "pretrained.py", str(pretrained))
    assert len(list(pretrained.glob("*.safetensors"))) > 1
    run_example(
        example / "train.py",
        *fit_args(
            "hf_finetune",
            tmp_path,
            f"--model.pretrained={pretrained}",
            f"--trainer.strategy.init_args.init_weights={pretrained}",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=2",
        ),
    )
    metrics = logged(tmp_path)
    assert len(metrics["train_loss"]) == 2 and len(metrics["val_loss"]) == 2
    # the example's pretrained weights are random: near ln(256) = 5.5, and 4 steps move the loss down
    assert metrics["val_loss"][-1] < metrics["val_loss"][0] < 5.6
    (checkpoint,) = tmp_path.rglob("last.ckpt")
    exported = tmp_path / "fine-tuned"
    run_example(ROOT / "lightning_pipe" / "checkpoint" / "__main__.py", "export-hf", str(checkpoint), str(exported))
    out = run_example(example / "evaluate.py", str(pretrained), str(exported))
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "held-out loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.extended
def test_fabric_example_matches_its_plain_loop(tmp_path: Path) -> None:
    """The README's two commands: the pipelined Fabric loop prints the losses and clip norms of the plain one."""
    script = EXAMPLES / "fabric" / "train_gpt.py"
    piped = run_example(script, "--steps", "3", "--save", str(tmp_path / "ckpt"))
    plain = run_example(script, "--steps", "3", "--devices", "1", "--plain")
    lines = lambda out: [line for line in out.splitlines() if line.startswith("step ")]  # noqa: E731
    assert len(lines(piped)) == 3 and lines(piped) == lines(plain)
    assert (tmp_path / "ckpt" / "lightning_pipe.json").is_file()
