"""Lightning callbacks for pipelined training."""

from lightning_pipe.callbacks.timeline import PipelineTimeline

__all__ = ["PipelineTimeline"]
