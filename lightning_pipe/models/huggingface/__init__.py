"""transformers models: pipeline plan, stage entry and exit, tensor-parallel plan, names on disk
(:class:`~lightning_pipe.models.huggingface.kind.HuggingFaceKind`). transformers is optional: nothing here imports it
at module level."""
