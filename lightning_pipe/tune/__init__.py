"""Choosing the strategy's settings by measuring them: ``lightning_pipe.tune(trainer, model, datamodule=...)``.

``space`` (the candidates), ``cost`` (the cost model), ``prune`` (what to measure, what wins), ``record`` (the choice
on disk) are pure; ``profile`` measures units on one process; ``trial`` runs a candidate in a Trainer of its own;
``tuner`` puts them together.
"""

from lightning_pipe.tune.space import Candidate, SearchSpace
from lightning_pipe.tune.tuner import TuneResult, tune

__all__ = ["Candidate", "SearchSpace", "TuneResult", "tune"]
