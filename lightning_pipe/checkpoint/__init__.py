"""Where checkpoints are written: directory checkpoints of per-rank shards, and conversion to and from single files.

- :mod:`lightning_pipe.checkpoint.format`: the directory layout, manifest and pure checks.
- :mod:`lightning_pipe.checkpoint.optim`: optimizer state keyed by parameter name, and its mapping to and from one
  device's form (parameters by position in ``configure_optimizers``' order).
- :mod:`lightning_pipe.checkpoint.save`: a save in two halves (the state, synchronous or asynchronous, and every
  rank's resume point), committed when both are on disk.
- :mod:`lightning_pipe.checkpoint.io`: collective load used by ``PipelineParallelStrategy``, including resuming ``fit``
  from a single-device ``.ckpt``.
- :mod:`lightning_pipe.checkpoint.latest` and :mod:`lightning_pipe.checkpoint.resume`: the newest complete checkpoint
  a restarted run resumes from; one Trainer entry's checkpoint session.
- :mod:`lightning_pipe.checkpoint.hooks`: the strategy's checkpoint hooks.
- :mod:`lightning_pipe.checkpoint.convert`: ``python -m lightning_pipe.checkpoint`` (consolidate to one ``.ckpt``,
  optionally with optimizer state).
- :mod:`lightning_pipe.checkpoint.export` and :mod:`lightning_pipe.checkpoint.adapters`: ``export-hf`` and
  ``init_adapter``, through the model kind's files (``lightning_pipe.models.files.StateDictAdapter``); a kind's
  pretrained directory (``init_weights``) is read by :func:`lightning_pipe.checkpoint.io.load_pretrained`. This
  package knows no model family: transformers and peft files live in ``lightning_pipe/models/``.
"""
