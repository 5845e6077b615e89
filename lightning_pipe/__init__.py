"""lightning-pipe: pipeline parallelism for PyTorch Lightning, as ``Trainer(strategy="pipeline")``."""

__version__ = "0.1.0"

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.errors import (
    MicrobatchError,
    PipelineCheckpointError,
    PipelineConfigError,
    PipelineModelError,
    PipelinePeerFailure,
    PipelineUsageError,
)
from lightning_pipe.fabric import PipelineFabricStrategy
from lightning_pipe.strategy import PipelineParallelStrategy
from lightning_pipe.tune import SearchSpace, TuneResult, tune

# Lightning has no entry-point discovery for strategies: registering on import is what makes the string work.
if PipelineParallelStrategy.strategy_name not in StrategyRegistry:
    PipelineParallelStrategy.register_strategies(StrategyRegistry)
# Fabric resolves `Fabric(strategy="...")` through a registry of its own.
if PipelineFabricStrategy.strategy_name not in FABRIC_STRATEGY_REGISTRY:
    PipelineFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "MicrobatchError",
    "PipelineCheckpointError",
    "PipelineConfigError",
    "PipelineFabricStrategy",
    "PipelineModelError",
    "PipelineParallelStrategy",
    "PipelinePeerFailure",
    "PipelineUsageError",
    "SearchSpace",
    "TuneResult",
    "__version__",
    "tune",
]
