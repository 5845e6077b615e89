"""The stage adapter: each stage runs with its own microbatch's network call, captured on its own rank.

Every rank captures the network call of every microbatch (:class:`~lightning_pipe.step.interception.CallInterceptor`).
A :class:`StageModule` is what torch's ``PipelineStage`` drives: it receives only the activation of the previous stage
(nothing on the first stage), takes every other argument of the call (masks, position ids, a rope cache, ``None``,
numbers, a ``BlockMask``) from the step's :class:`StepContext` for the microbatch being run, and calls the stage
through the split's *stage call* (:data:`lightning_pipe.models.base.StageCall`), which knows how the network takes an
activation in place of its input. Only the activation crosses ranks; side inputs never enter backward, so the
split-backward (zero-bubble) schedules work.

Per-step state: the step's :class:`StepContext` is :attr:`StageModule.step`, set by the executor on every stage
module of the rank for the duration of the step (not a keyword of ``schedule.step(**kwargs)``, which torch's pytree
code would copy for every microbatch, on every rank); the microbatch index arrives as ``microbatch=`` (added by
:class:`ChunkAwareStage`, or by the evaluation executor; absent in torch's shape inference).

On the last stage the network's output (a tensor, a tuple, a dict, a ``ModelOutput``) is flattened to its tensors for
torch and rebuilt before the user's step sees it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lightning_pipe.comm import collectives
from lightning_pipe.comm.transport import pack, unpack
from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.errors import PipelineUsageError
from lightning_pipe.models.base import StageCall
from lightning_pipe.models.huggingface.loss_items import Counted, counting, loss_candidates
from lightning_pipe.models.plain import activation_argument
from lightning_pipe.step.interception import Call
from lightning_pipe.structures import is_dtensor

DOCS_STAGE_ERRORS = "docs/troubleshooting.md#errors-raised-inside-a-stage"
#: the keyword argument under which a stage's forward receives the microbatch index
MICROBATCH = "microbatch"
#: the skeleton of a last stage's output that is one tensor
_TENSOR = object()
#: StageModule attributes that are never parameters, buffers or modules
_PLAIN_ATTRIBUTES = frozenset({"recorder", "sync_gradients", "loss_candidates", "on_receive", "step"})

#: ``on_output(microbatch, output) -> loss to back-propagate`` (training) or ``None`` (evaluation)
OnOutput = Callable[[int, Any], Any]


@dataclass
class StepContext:
    """One step on one rank: the network calls of its microbatches and what the last stage produced for them.

    Made by the step protocol for each step and handed to the executor, which passes it to every stage call.
    """

    #: this rank's network call of every microbatch
    calls: list[Call]
    #: the size of every microbatch (samples)
    sizes: list[int]
    #: on the last stage: what receives each microbatch's output (``None`` on other ranks)
    on_output: OnOutput | None = None
    #: output structure of the last stage per microbatch (its tensors travel through torch)
    skeletons: dict[int, Any] = field(default_factory=dict)
    #: the first exception raised inside a stage during the step, re-raised as is by the executor
    failure: BaseException | None = None
    #: the last stage ran torch's shape inference: its loss function is next, on no real microbatch
    inference_output: bool = False
    #: on the last stage: the token-mean losses the model's own loss function computed per microbatch, with their
    #: item counts (:mod:`lightning_pipe.models.huggingface.loss_items`)
    counted: dict[int, list[Counted]] = field(default_factory=dict)
    #: called as a stage of this rank posts a receive from another rank inside a training schedule, where the rank
    #: waits anyway: the step's outcome channel posts its own receive there (the executor hands it to the stages)
    on_receive: Callable[[], None] | None = None

    def final_output(self, microbatch: int, tensors: Any) -> Any:
        """The network's output for ``microbatch`` rebuilt from the tensors the last stage returned."""
        skeleton = self.skeletons[microbatch]
        if skeleton is _TENSOR:  # the usual output: returned as `(output,)`
            return tensors[0] if isinstance(tensors, (tuple, list)) else tensors
        return unpack(skeleton, list(tensors) if isinstance(tensors, (tuple, list)) else [tensors])


@contextmanager
def eval_mode(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every module in eval mode (dropout off, BatchNorm on running statistics); each one's own flag restored after.

    Stage views are shallow copies of the network, so their containers carry ``training`` flags of their own that
    ``LightningModule.eval()`` does not reach.
    """
    flags = [(m, m.training) for root in modules for m in root.modules()]
    for m, _ in flags:
        m.training = False
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


class StageModule(nn.Module):
    """One pipeline stage as torch's ``PipelineStage`` drives it (see the module docstring).

    A forward without a microbatch index is torch's shape inference, which runs on the first microbatch's call in eval
    mode (on stages after the first, torch feeds it uninitialised tensors that must not reach BatchNorm's running
    statistics).
    """

    def __init__(
        self, body: nn.Module, index: int, num_stages: int, stage_call: StageCall, absent_units: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.body = body
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.absent_units = tuple(absent_units)
        #: whether torch's data-parallel reduction (FSDP) runs at the end of this schedule step; off for the
        #: batches of an accumulation window before its last
        self.sync_gradients = True
        #: a :class:`~lightning_pipe.measure.timeline.TimelineRecorder` while a timeline is recorded, else ``None``
        self.recorder: Any = None
        #: the last stage's modules that may compute a counted token-mean loss (:func:`loss_candidates`), found on its
        #: first real forward (not a state-dict entry: a plain list, set past nn.Module's registration)
        self.loss_candidates: list[nn.Module] | None = None
        #: while a training schedule runs: the step's :attr:`StepContext.on_receive`
        self.on_receive: Callable[[], None] | None = None
        #: while an executor runs a step: that step (set and cleared by the executor)
        self.step: StepContext | None = None
        # Not a submodule: shared by every stage of the rank, and not part of any state dict.
        self.__dict__["stage_call"] = stage_call

    def __setattr__(self, name: str, value: Any) -> None:
        # Plain attributes skip nn.Module's search of parameters, buffers and submodules.
        if name in _PLAIN_ATTRIBUTES:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)
            if name == "body":
                # The body stays a registered submodule (`body.` in the state dict); the forward reads this plain
                # reference to it, not through nn.Module's __getattr__ (once per microbatch).
                self.__dict__["held"] = value

    def forward(self, *received: torch.Tensor, microbatch: int | None = None) -> Any:
        step = self.step
        assert step is not None, "a stage runs inside an executor's step"
        call = step.calls[0 if microbatch is None else microbatch]
        activation = None if self.is_first else tuple(received)
        body = self.held
        try:
            if microbatch is None:
                with eval_mode([body]):
                    output = self.stage_call(body, call.args, call.kwargs, activation, self.is_first, self.is_last)
            elif self.is_last:
                candidates = self.loss_candidates
                if candidates is None:
                    candidates = self.loss_candidates = loss_candidates(body)
                if candidates:
                    with counting(body, candidates) as step.counted[microbatch]:
                        output = self.stage_call(body, call.args, call.kwargs, activation, self.is_first, True)
                else:  # a plain network: nothing to count (the protocol reads a missing entry as none counted)
                    output = self.stage_call(body, call.args, call.kwargs, activation, self.is_first, True)
            else:
                output = self.stage_call(body, call.args, call.kwargs, activation, self.is_first, self.is_last)
        except Exception as err:
            step.failure = step.failure or err
            add_note(err, self.describe_failure(call, activation, microbatch))
            raise
        if not self.is_last:
            if type(output) is torch.Tensor and (output.requires_grad or not torch.is_grad_enabled()):
                return output  # the usual activation, as :meth:`_activation` would pass it
            return self._activation(output)
        step.inference_output = microbatch is None
        slot = 0 if microbatch is None else microbatch
        if isinstance(output, torch.Tensor):  # the usual output: no structure to pack
            step.skeletons[slot] = _TENSOR
            return (output,)
        skeleton, tensors = pack(output, detach=False)
        step.skeletons[slot] = skeleton
        return tuple(tensors)

    def _activation(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and (output.requires_grad or not torch.is_grad_enabled()):
            return output  # the usual activation, as the checks below would pass it (run on every microbatch)
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise PipelineUsageError(
                f"Pipeline stage {self.index} returned {type(output).__name__}"
                f"{'' if not isinstance(output, (tuple, list)) else ' of ' + _types(leaves)}; a stage before the last"
                " must return its activation as a tensor or a tuple of tensors (only the activation travels to the"
                " next stage; masks and other arguments reach every stage from the step's own call). Make the"
                " network's forward return the hidden state when its head is absent (None)."
            )
        if torch.is_grad_enabled() and not any(t.requires_grad for t in leaves):
            # A stage whose parameters are all frozen (an adapter fine-tune's embedding) sends an activation without
            # gradient; torch then receives it as not needing one on the next stage, whose split backward (I/W)
            # computes its weights' gradients from the input gradient's path and loses parts of them. (A stage that
            # sends some values with gradient sends the others as they are: the dataflow frontend's masks.)
            leaves = [_needing_grad(t) for t in leaves]
            output = tuple(leaves) if isinstance(output, (tuple, list)) else leaves[0]
        return tuple(leaves) if isinstance(output, (tuple, list)) else output

    def describe_failure(self, call: Call, activation: tuple | None, microbatch: int | None) -> str:
        where = (
            f"lightning-pipe: raised on rank {collectives.world_rank()} in pipeline stage {self.index} of"
            f" {self.num_stages}"
            + (" during torch's shape inference" if microbatch is None else f" (microbatch {microbatch})")
            + "."
        )
        parts = [where]
        describe = getattr(self.stage_call, "describe_failure", None)
        if describe is not None:  # a frontend with other stages than "the activation in place of the input"
            return " ".join([*parts, describe(self.index)])
        if self.absent_units:
            shown = ", ".join(self.absent_units[:8]) + (" ..." if len(self.absent_units) > 8 else "")
            parts.append(f"Units held by other stages are absent (None) here: {shown}.")
        if activation is not None:
            parts.append(
                f"On this stage {activation_argument(self.body, call.args, len(activation))} holds the activation"
                f" received from stage {self.index - 1} ({_types(activation)}), not the network's input."
            )
        parts.append(
            "The network's forward must skip absent units and code that only applies to the network's input"
            f" (e.g. `if self.embed is not None:`); see {DOCS_STAGE_ERRORS}."
        )
        if any(is_dtensor(p) for p in self.body.parameters()):
            parts.append(
                "With tensor parallelism it must: the dataflow frontend, which runs a forward unchanged, does not take"
                " `tensor_parallel > 1`."
            )
        else:
            parts.append(
                "A forward that cannot (an nn.Transformer, later units reading earlier units' outputs) runs unchanged"
                " with `frontend='dataflow'`."
            )
        return " ".join(parts)


def _needing_grad(t: torch.Tensor) -> torch.Tensor:
    """``t``, or (a floating-point tensor without gradient) a leaf alias of it that requires one."""
    if t.requires_grad or not (t.is_floating_point() or t.is_complex()):
        return t
    return t.detach().requires_grad_(True)


def _types(values: Sequence[Any]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"tensor {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
        return type(v).__name__

    return ", ".join(one(v) for v in values)


def add_note(err: BaseException, note: str) -> None:
    """Attach ``note`` to ``err`` keeping its type and traceback (PEP 678; older Pythons get it in the message)."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    elif err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{note}", *err.args[1:])


def chunk_aware_stage_class() -> type:
    """``PipelineStage`` that tells its :class:`StageModule` which microbatch each forward runs.

    torch calls ``forward_one_chunk(fwd_chunk_id, args, kwargs)`` for every real forward, in every schedule, with the
    keyword arguments of ``schedule.step``; its shape inference calls the module directly. The override adds the
    microbatch index to those keyword arguments: that is how a stage knows which microbatch's side inputs to use.

    The forward also reports to the stage's timeline recorder when one is attached
    (:mod:`lightning_pipe.measure.timeline`). The backward ones and those that hand the schedule its point-to-point
    operations report through methods :func:`watch` installs only while a step needs them. (The methods are
    :class:`_StageActions`, a mixin before torch's class.)
    """
    from torch.distributed.pipelining import PipelineStage

    class ChunkAwareStage(_StageActions, PipelineStage):
        pass

    torch_compat.connect_neighbours_on_other_ranks_only(ChunkAwareStage)
    return ChunkAwareStage


class _StageActions:
    """The overrides of :func:`chunk_aware_stage_class`, each calling torch's own through ``super()``.

    Two always replace torch's: :meth:`forward_one_chunk` (the microbatch index, every microbatch) and
    :meth:`perform_reduce_grad` (once a step). The ``watched_*`` ones report what only some steps need: to a timeline
    recorder, that a receive was posted (:attr:`StepContext.on_receive`), a split backward run whole. :func:`watch`
    installs them on a stage, as instance attributes over torch's methods, while it needs them; elsewhere torch's own
    run, without a call of ours around each (measured: 6 calls a microbatch on a last stage).
    """

    submod: StageModule
    stage_index: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: microbatches whose split backward ran whole (:func:`_split_or_whole`): their weight pass is done
        self.whole_backwards: set[int] = set()
        #: the groups of reports installed (:func:`watch`)
        self.watching: frozenset[str] = frozenset()
        #: the stage call runs some split backwards whole (the dataflow frontend): its backwards are always watched
        self.splits_backward = getattr(self.submod.stage_call, "full_backward", None) is not None
        watch(self)

    def forward_one_chunk(self, fwd_chunk_id: int, args: Any, kwargs: Any = None, *rest: Any, **options: Any) -> Any:
        kwargs = {**kwargs, MICROBATCH: fwd_chunk_id} if kwargs else {MICROBATCH: fwd_chunk_id}
        base = super().forward_one_chunk  # type: ignore[misc]
        if self.submod.recorder is None:
            output = base(fwd_chunk_id, args, kwargs, *rest, **options)
        else:
            output = _timed(self, "F", fwd_chunk_id, base, (args, kwargs, *rest), options)
        if torch_compat.KEEPS_EVERY_INPUT:
            torch_compat.keep_tensor_inputs(self, fwd_chunk_id)
        return output

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # torch reduce-scatters an FSDP stage's gradients after the step's last backward. Inside an accumulation
        # window the unsharded gradients keep accumulating instead (FSDP left them unsynchronised and the
        # parameters unsharded during each backward), so the window synchronises once, at its last batch.
        if self.submod.sync_gradients:
            super().perform_reduce_grad(grad_scale_factor)  # type: ignore[misc]
        elif grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------------ watched
    # Installed by watch() under torch's names (get_fwd_recv_ops, ...): WATCHED maps each group to them.
    def watched_backward(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("full_backward") is False:
            kwargs = _split_or_whole(self, bwd_chunk_id, kwargs)
        return _timed(self, "B", bwd_chunk_id, super().backward_one_chunk, args, kwargs)  # type: ignore[misc]

    def watched_weight(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        return _weight_pass(self, bwd_chunk_id, super().backward_weight_one_chunk, args, kwargs)  # type: ignore[misc]

    def watched_fwd_recv(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)  # type: ignore[misc]
        return _posted(self, ops, "recv", "F", fwd_chunk_id) if ops else ops

    def watched_bwd_recv(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)  # type: ignore[misc]
        return _posted(self, ops, "recv", "B", bwd_chunk_id) if ops else ops

    def watched_fwd_send(self, fwd_chunk_id: int) -> list:
        return _posted(self, super().get_fwd_send_ops(fwd_chunk_id), "send", "F", fwd_chunk_id)  # type: ignore[misc]

    def watched_bwd_send(self, bwd_chunk_id: int) -> list:
        return _posted(self, super().get_bwd_send_ops(bwd_chunk_id), "send", "B", bwd_chunk_id)  # type: ignore[misc]


#: the reports :func:`watch` installs, by group: torch's method name and the :class:`_StageActions` method over it
WATCHED = {
    "receives": (("get_fwd_recv_ops", "watched_fwd_recv"), ("get_bwd_recv_ops", "watched_bwd_recv")),
    "sends": (("get_fwd_send_ops", "watched_fwd_send"), ("get_bwd_send_ops", "watched_bwd_send")),
    "backwards": (("backward_one_chunk", "watched_backward"), ("backward_weight_one_chunk", "watched_weight")),
}


def watch(stage: Any) -> None:
    """Install on ``stage`` (a :func:`chunk_aware_stage_class` stage) the reports its module needs now, and take off
    the others: receives while a timeline recorder is attached or the step's outcome is received
    (:attr:`StageModule.on_receive`), sends while recording, backwards while recording or where the stage call splits
    backwards its own way. Called as each step starts; it changes the stage only when what is needed changed."""
    submod = stage.submod
    recording = submod.recorder is not None
    needed = {
        "receives": recording or submod.on_receive is not None,
        "sends": recording,
        "backwards": recording or stage.splits_backward,
    }
    wanted = frozenset([group for group, yes in needed.items() if yes])
    if wanted == stage.watching:
        return
    attributes = stage.__dict__
    for group, methods in WATCHED.items():
        for name, watched in methods:
            if group in wanted:
                attributes[name] = getattr(stage, watched)
            else:
                attributes.pop(name, None)
    stage.watching = wanted


def _split_or_whole(stage: Any, chunk: int, kwargs: dict) -> dict:
    """The keyword arguments of a backward: a split one (``full_backward=False``) runs whole where the stage call
    says so (the dataflow frontend, for a stage whose trainable units read nothing the stage received: torch's split
    backward loses their weight gradients, :func:`lightning_pipe.split.routing.off_input`); the weight pass of that
    microbatch then has nothing left to do."""
    check = getattr(stage.submod.stage_call, "full_backward", None)
    if kwargs.get("full_backward") is False and check is not None and check(stage.stage_index):
        stage.whole_backwards.add(chunk)
        return {**kwargs, "full_backward": True}
    return kwargs


def _weight_pass(stage: Any, chunk: int, action: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run the weight pass of ``chunk``, unless its backward ran whole (:func:`_split_or_whole`)."""
    if chunk in stage.whole_backwards:
        stage.whole_backwards.discard(chunk)
        return None
    return _timed(stage, "W", chunk, action, args, kwargs)


def _timed(stage: Any, kind: str, chunk: int, action: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run a schedule action of ``stage``, reporting it to the stage's timeline recorder if one is attached."""
    recorder = stage.submod.recorder
    if recorder is None:
        return action(chunk, *args, **kwargs)
    start = recorder.now()
    result = action(chunk, *args, **kwargs)
    recorder.compute(kind, stage.stage_index, chunk, start)
    return result


def _posted(stage: Any, ops: list, op: str, kind: str, chunk: int) -> list:
    """Pass ``ops`` on; tell the timeline recorder (if any) that they were posted, and the step that a receive was
    (:attr:`StepContext.on_receive`: once per stage and step, the stage's first receive)."""
    if ops:
        submod = stage.submod
        if submod.recorder is not None:
            submod.recorder.posted(op, kind, stage.stage_index, chunk)
        if op == "recv" and submod.on_receive is not None:
            on_receive, submod.on_receive = submod.on_receive, None
            on_receive()
    return ops
