"""Where checkpoints are written: directory checkpoints of per-rank shards, and conversion to and from single files.

- :mod:`lightning_pipe.checkpoint.format`: the directory layout, manifest and pure checks.
- :mod:`lightning_pipe.checkpoint.optim`: optimizer state keyed by parameter name, and its mapping to and from one
  device's form (parameters by position in ``configure_optimizers``' order).
- :mod:`lightning_pipe.checkpoint.io`: collective save/load used by ``PipelineParallelStrategy``, including resuming
  ``fit`` from a single-device ``.ckpt``.
- :mod:`lightning_pipe.checkpoint.convert`: ``python -m lightning_pipe.checkpoint`` (consolidate to one ``.ckpt``,
  optionally with optimizer state).
"""
