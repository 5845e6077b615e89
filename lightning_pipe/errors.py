"""Exception types raised by lightning-pipe.

Each one subclasses the built-in type a caller would expect (``ValueError`` for a bad setting, ``TypeError`` for a
model the strategy cannot split), so existing ``except ValueError`` handlers keep working.
"""


class PipelineConfigError(ValueError):
    """A strategy argument, or a combination of arguments and world size, that cannot work."""


class PipelineModelError(TypeError):
    """The LightningModule or its network cannot be split into pipeline stages as configured."""


class MicrobatchError(ValueError):
    """A batch that cannot be split into the configured number of equal microbatches."""


class PipelineUsageError(RuntimeError):
    """A LightningModule hook used the pipelined network in a way the pipeline cannot run."""


class PipelineCheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted, or does not match the model, optimizers or schedulers it is
    loaded into."""


class PipelinePeerFailure(RuntimeError):
    """Another rank failed first, and this rank's communication with it broke. The message names that rank, its
    pipeline stages, what it was doing and its error; its traceback follows as a note (Python >= 3.11)."""
