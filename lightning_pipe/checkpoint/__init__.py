"""Where checkpoints are written: directory checkpoints of per-rank shards, and conversion to and from single files.

- :mod:`lightning_pipe.checkpoint.format`: the directory layout, manifest and pure checks.
- :mod:`lightning_pipe.checkpoint.io`: collective save/load used by ``PipelineParallelStrategy``.
- :mod:`lightning_pipe.checkpoint.convert`: ``python -m lightning_pipe.checkpoint`` (consolidate to one ``.ckpt``).
"""
