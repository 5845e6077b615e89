"""lightning-pipe: pipeline parallelism for PyTorch Lightning, as ``Trainer(strategy="pipeline")``."""

__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.errors import (
    MicrobatchError,
    PipelineCheckpointError,
    PipelineConfigError,
    PipelineModelError,
    PipelinePeerFailure,
    PipelineUsageError,
)
from lightning_pipe.strategy import PipelineParallelStrategy
from lightning_pipe.tune import SearchSpace, TuneResult, tune

# Lightning has no entry-point discovery for strategies: registering on import is what makes the string work.
if PipelineParallelStrategy.strategy_name not in StrategyRegistry:
    PipelineParallelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "MicrobatchError",
    "PipelineCheckpointError",
    "PipelineConfigError",
    "PipelineModelError",
    "PipelineParallelStrategy",
    "PipelinePeerFailure",
    "PipelineUsageError",
    "SearchSpace",
    "TuneResult",
    "__version__",
    "tune",
]
