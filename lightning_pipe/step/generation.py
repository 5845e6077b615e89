"""Generating inside a step: ``self.model.generate(...)`` in ``validation_step``, ``test_step`` and ``predict_step``.

A step whose first use of the network is ``generate`` runs in *lockstep*: every rank of the pipeline runs the user's
step on the whole batch, so every rank runs the model's own ``generate`` loop (logits processors, stopping criteria,
padding of finished rows, sampling). Each network call of that loop is one pass through the stages
(:meth:`Lockstep.answer`): the call's rows are split into chunks that travel through the stages in flight, each stage
keeps the key/value cache of its own layers per chunk, and the last stage's output (the next-token logits) reaches
every rank, which therefore chooses the same tokens. The first stage gets the chosen tokens from its own rank's loop.

Every rank draws the same random numbers: the step's compute stream is the last stage's on every rank
(:meth:`lightning_pipe.step.rng.RngStreams.agree`), and sampling sees the whole batch at once, as on one device.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_pipe.comm import collectives
from lightning_pipe.comm.transport import pack, unpack
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.microbatch import batch_size
from lightning_pipe.models import kind_of
from lightning_pipe.models.base import Decoding
from lightning_pipe.step.executors.forward_only import ForwardOnlyExecutor, microbatch_sizes, resolve_eval_microbatches
from lightning_pipe.step.interception import Call
from lightning_pipe.step.runtime import PipelineRuntime
from lightning_pipe.step.stage import StepContext


def decoding_of(network: nn.Module, runtime: PipelineRuntime, hook: str) -> Decoding:
    """How ``network`` decodes under the pipeline; refuses a generating step that cannot run exactly (in training, on
    stages that do not run the kind's own stage call: the dataflow or trace frontends keep no cache)."""
    name = type(network).__name__
    if hook == "training_step":
        raise PipelineUsageError(
            f"`training_step` called `{name}.generate(...)`: under PipelineParallelStrategy a training step runs one"
            " forward and backward pass per microbatch through the schedule. Generate in `validation_step`,"
            " `test_step` or `predict_step`."
        )
    kind = kind_of(network)
    decoding = kind.decoding()
    if decoding is None:
        raise PipelineUsageError(
            f"`{name}.generate(...)` was called in `{hook}`, but a {kind.name} does not decode under"
            " PipelineParallelStrategy: each stage keeps only its own layers' key/value cache, and the forward of a"
            f" {kind.name} does not say which argument and output carry a per-layer cache. Only the own `generate` of a"
            " transformers model (or of a PEFT model around one) decodes (its forward takes `past_key_values`, a"
            " transformers `Cache` indexed by layer, with `cache_position`, and returns it). Build the network as a"
            " transformers model to generate, or call the network once per step (the whole sequence, no cache)."
        )
    calls = {type(s.stage_call).__name__ for s in runtime.stages.values() if s.stage_call is not kind.stage_call}
    if calls:
        raise PipelineUsageError(
            f"`{name}.generate(...)` under PipelineParallelStrategy needs stages that run the model's own forward"
            f" (frontend='auto' or 'modules'); these stages run through {sorted(calls)}, which keep no key/value cache."
            " Use `frontend='auto'`."
        )
    return decoding


class Lockstep:
    """Answers the network's calls while a generating step runs on every rank of the pipeline (see the module
    docstring). One per step."""

    def __init__(
        self, runtime: PipelineRuntime, executor: ForwardOnlyExecutor, network: nn.Module, decoding: Decoding
    ) -> None:
        self.runtime, self.executor, self.network, self.decoding = runtime, executor, network, decoding
        #: while ``generate`` runs: the stage caches of each row chunk (made at its first network call)
        self._chunks: list[Any] | None = None
        self._generating = False

    def generate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model's own ``generate`` on this rank, its network calls answered by :meth:`answer`."""
        self.decoding.check(self.network, args, kwargs)
        self._generating, self._chunks = True, None
        try:
            return self.decoding.generate(self.network, args, kwargs)
        finally:
            self._generating, self._chunks = False, None

    def answer(self, call: Call) -> Any:
        """One network call, made alike on every rank: one pass through the stages; the last stage's output on every
        rank."""
        runtime, decoding = self.runtime, self.decoding
        if self._generating:
            rows = decoding.rows(call.kwargs)
            n = resolve_eval_microbatches(self.executor.eval_microbatches, rows, runtime.pipeline_size)
            sizes = microbatch_sizes(rows, n)
            if self._chunks is None or len(self._chunks) != len(sizes):
                self._chunks = [decoding.new_caches() for _ in sizes]
            starts = [sum(sizes[:m]) for m in range(len(sizes))]
            calls = [
                Call((), decoding.chunk(call.kwargs, rows, a, a + size, caches))
                for a, size, caches in zip(starts, sizes, self._chunks)
            ]
        else:
            sizes, calls = [batch_size((call.args, call.kwargs))], [call]
        outputs: dict[int, Any] = {}
        step = StepContext(calls, sizes)
        step.on_output = outputs.__setitem__
        self.executor.run(("lockstep", len(sizes)), step)
        last = runtime.last_stage_global_rank
        merged = None
        if runtime.has_last:
            ordered = [outputs[m] for m in range(len(sizes))]
            merged = decoding.merge(ordered) if self._generating else ordered[0]
        skeleton, tensors = pack(merged) if merged is not None else (None, [])
        shared = collectives.broadcast_object((skeleton, [t.cpu() for t in tensors]), last, runtime.group)
        if merged is None:
            merged = unpack(shared[0], [t.to(runtime.device) for t in shared[1]])
        return decoding.answer(merged, call.kwargs) if self._generating else merged
