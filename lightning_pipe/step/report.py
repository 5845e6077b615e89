"""What the user is told before the first step: the whole model's size beside the model summary, and a training
loader whose batches cannot be split into microbatches (at ``fit`` start, once, instead of at the end of the epoch).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_pipe.comm import collectives
from lightning_pipe.errors import MicrobatchError, PipelineConfigError
from lightning_pipe.microbatch import epoch_batch_sizes
from lightning_pipe.reliability.loaders import PassLoader
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.split.builder import Split
from lightning_pipe.step.executors.schedule import microbatch_count, microbatch_plan


def _count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return str(n)


def announce_parameters(trainer: Any, module: Any, pipeline_group: Any, split: Split) -> None:
    """Before Lightning's model summary (which counts the parameters rank 0 holds): say that it shows rank 0's
    stages only, and how many parameters the whole model has (a parameter shared by several stages counted once).

    Collective over the pipeline group; says nothing without a model summary.
    """
    from lightning.pytorch.callbacks import ModelSummary

    if not any(isinstance(c, ModelSummary) for c in trainer.callbacks):
        return
    copies = {split.prefix + name for tie in split.ties for name in tie.names[1:]}
    params = {id(p): p for name, p in module.named_parameters(remove_duplicate=False) if name not in copies}
    mine = (sorted(split.bodies), sum(p.numel() for p in params.values()))
    everyone = collectives.all_gather_object(mine, pipeline_group)
    total = sum(n for _, n in everyone)
    if total == mine[1]:
        return
    stages = ", ".join(f"stages {s} {_count(n)}" for s, n in everyone)
    rank_zero_info(
        f"lightning-pipe: the model summary below counts the parameters of this rank's stages {mine[0]} only; the"
        f" whole model has {_count(total)} parameters ({stages})."
    )


def check_training_batches(trainer: Any, settings: PipelineSettings, global_rank: int) -> None:
    """Before the first step: say (rank 0) which training batches run as another number of microbatches than the
    configured one (a short last batch: :func:`~lightning_pipe.step.executors.schedule.microbatch_count`), and refuse
    a batch that no number of equal microbatches can run. Rank 0 raises with the whole explanation, the others with
    a pointer to it.

    Only plain ``DataLoader``s whose size is known are checked; others are planned at the batch itself.
    """
    sizes = _batch_sizes(trainer)
    if sizes is None:
        return
    for which, size in sizes:
        try:
            n, schedule = microbatch_plan(settings, size)
        except MicrobatchError as err:
            if global_rank != 0:
                raise MicrobatchError(
                    "The training DataLoader yields a batch that cannot be split into microbatches; rank 0 says why."
                ) from None
            raise MicrobatchError(
                f"The training DataLoader's {which} has {size} samples: {err} (Checked before the first step.)"
            ) from None
        if schedule != settings.schedule:
            rank_zero_info(
                f"lightning-pipe: the training DataLoader's {which} has {size} samples, which torch's"
                f" {settings.schedule} schedule cannot run as equal microbatches on {settings.num_stages} stages: it"
                f" runs as {n} microbatch{'es' if n > 1 else ''} of {size // n} under {schedule}, on the same stages"
                " (losses and gradients as on one device)."
            )
        elif n != _configured(settings, size):
            rank_zero_info(
                f"lightning-pipe: the training DataLoader's {which} has {size} samples, which the configured"
                f" microbatches do not split equally: it runs as {n} microbatches of {size // n} (losses and"
                " gradients as on one device)."
            )


def batch_arithmetic(batch: int | None, accumulate: int, data_parallel_size: int, world_size: int) -> str:
    """What one optimizer step trains on, for a data-parallel size that is not the world size: the samples, and the
    data-parallel size to divide a global batch by (not ``trainer.world_size``)."""
    per_replica = world_size // data_parallel_size
    parts = f"accumulate_grad_batches={accumulate} x data_parallel_size={data_parallel_size}"
    if batch:
        samples = f"{batch * accumulate * data_parallel_size} samples (batches of {batch} x {parts})"
    else:
        samples = f"the training DataLoader's batch x {parts}"
    return (
        f"lightning-pipe: each optimizer step trains on {samples}. The data-parallel size is {data_parallel_size}"
        f" and the world size {world_size}: the {per_replica} processes of each pipeline all see every sample of its"
        f" batch, so a batch size divided by `trainer.world_size` (the DDP idiom) is {per_replica}x smaller than"
        " intended. Divide by `trainer.strategy.data_parallel_size` instead."
    )


def announce_batch_arithmetic(trainer: Any, data_parallel_size: int, world_size: int) -> None:
    """At fit start, on rank 0: :func:`batch_arithmetic`, when the data-parallel size is not the world size."""
    if data_parallel_size == world_size:
        return
    sizes = _batch_sizes(trainer)
    batch = sizes[0][1] if sizes else None
    rank_zero_info(batch_arithmetic(batch, trainer.accumulate_grad_batches, data_parallel_size, world_size))


def _configured(settings: PipelineSettings, size: int) -> int:
    """The microbatch count the settings name for a batch of ``size`` (``size`` itself where it does not divide)."""
    if settings.microbatch_size is not None:
        return size // settings.microbatch_size if size % settings.microbatch_size == 0 else -1
    n = settings.num_stages if settings.microbatches == "auto" else int(settings.microbatches)
    return min(n, size) if settings.microbatches == "auto" else n


def _batch_sizes(trainer: Any) -> list[tuple[str, int]] | None:
    loader = trainer.train_dataloader
    if isinstance(loader, PassLoader):  # the resume wrapper around the user's loader (reliability/loaders.py)
        loader = loader.loader
    return epoch_batch_sizes(loader)


def check_supported(lightning_module: Any, precision_plugin: Any) -> None:
    """Refuse what a pipeline cannot run: a gradient scaler."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
        raise PipelineConfigError(
            f"`precision={precision_plugin.precision!r}` needs a gradient scaler whose inf/NaN checks would"
            " have to agree across stages; it is not supported. Use `precision='bf16-mixed'` (or '32-true',"
            " 'bf16-true')."
        )


#: Layers whose training output depends on the other samples of the batch (public classes; SyncBatchNorm included)
BATCH_DEPENDENT = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
)


def batch_dependent_modules(network: nn.Module, prefix: str = "") -> list[str]:
    """Names (with ``prefix``) of the modules of ``network`` whose training output depends on the whole batch."""
    return [f"{prefix}{name}" for name, m in network.named_modules() if isinstance(m, BATCH_DEPENDENT)]


def warn_batch_dependent(trainer: Any, settings: PipelineSettings, split: Split, pipeline_group: Any) -> None:
    """At fit start: name the batch-dependent layers (BatchNorm) that will see microbatches instead of the batch, why
    results then differ from one device, and the exact alternatives. Collective over the pipeline group."""
    mine = batch_dependent_modules(split.network, split.prefix)
    names = sorted({name for rank in collectives.all_gather_object(mine, pipeline_group) for name in rank})
    sizes = _batch_sizes(trainer) or []
    size = sizes[0][1] if sizes else None
    if size is not None:
        n = microbatch_count(settings, size)
    else:
        n = settings.microbatches if settings.microbatches != "auto" else settings.num_stages
    if not names or n == 1:
        return
    shown = ", ".join(f"`{name}`" for name in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    per = f"{size // n}-sample microbatches of each {size}-sample batch" if size else f"{n} microbatches of each batch"
    rank_zero_warn(
        f"lightning-pipe: {shown} normalise over the batch in training (BatchNorm), and a pipeline runs them once per"
        f" microbatch: their statistics (and the running mean/variance they track) come from the {per}, so results"
        f" differ from one device with the same batch (the pipeline equals one device given batches of"
        f" {f'{size // n} samples' if size else 'one microbatch'} and `accumulate_grad_batches` multiplied by {n})."
        " For one device's results, run one microbatch per batch: `PipelineParallelStrategy(schedule='GPipe',"
        " microbatches=1)` (the stages then take turns), or normalise per sample (LayerNorm, GroupNorm)."
    )
