"""Tensor parallelism inside pipeline stages: pipeline x data x tensor ("3D") parallelism, exact to one device.

Pure logic first (the 3-axis mesh, settings, Hugging Face plans, the norm's counting rule, re-tying, DTensor
transport and placement on a one-process group); then two launches of tests/scripts/tensor_parallel.py whose outputs
many tests read:

- 4 processes: a Llama-style decoder with the user's own plan at pp2 x tp2 under 1F1B, ZBVZeroBubble (with activation
  checkpointing), Interleaved1F1B, sequence parallelism with loss parallelism, DTensors across stage boundaries under
  DualPipeV (clipping, validation and token-weighted losses in each); a checkpoint saved at pp2 x tp2, resumed there
  (against an uninterrupted run) and at pp2 x tp1 x dp2; ``LlamaForCausalLM`` (untied and tied) and Qwen3 with their
  own plans; then every error scenario;
- 8 processes: pp2 x tp2 x dp2 with ``ddp`` and ``fsdp``, accumulation 2, clipping.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from packaging.version import Version
from torch import nn

from lightning_pipe import PipelineConfigError, PipelineModelError, PipelineParallelStrategy
from lightning_pipe.comm import transport
from lightning_pipe.comm.dtensor import Layout, assign_whole_, place_like, sharded_axes
from lightning_pipe.comm.mesh import MeshLayout
from lightning_pipe.compat import torch as torch_compat
from lightning_pipe.measure.memory import MemoryReport, StateBytes
from lightning_pipe.models.huggingface.tensor_parallel import full_plan, hf_tensor_parallel_plan
from lightning_pipe.parallel.grads import GradientStash, counted_once
from lightning_pipe.parallel.tensor_parallel import _differ, retie
from lightning_pipe.settings import PipelineSettings, resolve_pipeline_size
from lightning_pipe.split.builder import check_whole_before_split
from lightning_pipe.step.executors.schedule import step_options
from tests.groups import one_rank_group
from tests.launch import SHARED_FOUR, Launch, run_scenarios

TOL = 1e-5
CLIP = 0.5
TP2 = {"devices": 4, "pipeline_size": 2, "tensor_parallel": 2}
CK = {**TP2, "optimizer": "adam", "samples": 16, "shuffle": False, "val": 2}
FOUR = [
    {**TP2, "name": "1f1b", "clip": CLIP, "val": 2},
    {**TP2, "name": "zbv-ac", "clip": CLIP, "val": 2, "schedule": "ZBVZeroBubble", "activation_checkpointing": True},
    {**TP2, "name": "interleaved", "clip": CLIP, "val": 2, "schedule": "Interleaved1F1B"},
    {**TP2, "name": "sequence", "clip": CLIP, "val": 2, "plan": "sequence", "loss_parallel": True},
    {
        **TP2,
        "name": "dtensor",
        "clip": CLIP,
        "val": 2,
        "plan": "dtensor",
        "loss_parallel": True,
        "schedule": "DualPipeV",
    },
    {**CK, "name": "ck-save", "max_steps": 2, "save": "tp.ckpt"},
    {**CK, "name": "ck-resume", "max_steps": 4, "resume": "tp.ckpt"},
    {**CK, "name": "ck-straight", "max_steps": 4},
    # 2 replicas of 8 samples: one batch an epoch, no validation.
    {**CK, "name": "ck-reshard", "tensor_parallel": 1, "max_steps": 3, "resume": "tp.ckpt", "val": None},
    {**TP2, "name": "hf-llama", "clip": CLIP, "model": "hf"},
    {
        **TP2,
        "name": "hf-llama-tied",
        "clip": CLIP,
        "model": "hf",
        "tied": True,
        "schedule": "ZBVZeroBubble",
        "save": "hf-tp.ckpt",
    },
    # Initial weights from a Hugging Face model directory: into the user's DTensors, and before the model's own plan.
    {**TP2, "name": "init-dir", "max_steps": 1, "init_weights": "decoder-hf"},
    {**TP2, "name": "hf-init-dir", "model": "hf", "tied": True, "max_steps": 1, "init_weights": "llama-hf"},
    # ... and the network built from the directory's config in `configure_model` (docs/pretrained.md), several files.
    {**TP2, "name": "pretrained-dir", "model": "pretrained", "max_steps": 1, "init_weights": "llama-hf"},
    {**TP2, "name": "hf-qwen3", "clip": CLIP, "model": "hf", "family": "qwen3", "error": True},
    # Errors (each raised alike on every rank, so the launch goes on):
    {**TP2, "name": "err-tie-layouts", "plan": "head-only", "error": True},
    {**TP2, "name": "err-retie", "plan": "head-only", "schedule": "ZBVZeroBubble", "error": True},
    {**TP2, "name": "err-foreign-mesh", "plan": "foreign", "error": True},
    {**TP2, "name": "err-no-plan", "plan": "none", "error": True},
    {**TP2, "name": "err-split-late", "build_late": True, "error": True},
    {**TP2, "name": "err-whole-gradients", "qk_norm": True, "error": True},
]
DP = {"devices": 8, "pipeline_size": 2, "tensor_parallel": 2, "clip": CLIP, "accumulate": 2, "max_steps": 3}
EIGHT = [
    {**DP, "name": "ddp", "weighted": False},
    {**DP, "name": "fsdp", "weighted": False, "data_parallel": "fsdp"},
]


def _transformers_5() -> bool:
    import transformers

    return Version(transformers.__version__) >= Version("5")


# ---------------------------------------------------------------------------------------------------- a 1-rank group
@pytest.fixture(scope="module")
def one_rank():
    """A one-process gloo group (made here if none exists, and removed after): DTensors on one-rank meshes."""
    with one_rank_group():
        yield


def _mesh(*names: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)


# ---------------------------------------------------------------------------------------------------- pure logic
def test_the_mesh_has_three_axes_with_tensor_parallel_innermost():
    layout = MeshLayout(pipeline_size=2, data_parallel_size=2, tensor_parallel_size=2)
    assert layout.world_size == 8 and layout.shape == (2, 2, 2) and layout.axis_names == ("pp", "dp", "tp")
    # The processes sharing a stage are consecutive; then the stage's replicas; pipelines span the rest.
    assert [layout.rank(0, 0, t) for t in range(2)] == [0, 1]
    assert layout.replica_ranks(0, tp_rank=1) == [1, 3] and layout.pipeline_ranks(1, tp_rank=0) == [2, 6]
    assert [(layout.coordinates(r), layout.tensor_parallel_rank(r)) for r in (0, 3, 6)] == [
        ((0, 0), 0),
        ((1, 0), 1),
        ((1, 1), 0),
    ]
    assert layout.replica_members(1) == [2, 3, 6, 7]
    pipelines_inner = MeshLayout(2, 2, "pp", tensor_parallel_size=2)
    assert pipelines_inner.axis_names == ("dp", "pp", "tp") and pipelines_inner.pipeline_ranks(0) == [0, 2]
    assert all(
        pipelines_inner.rank(*pipelines_inner.coordinates(r), pipelines_inner.tensor_parallel_rank(r)) == r
        for r in range(8)
    )


def test_tensor_parallel_setting_is_checked_and_resolved(monkeypatch):
    monkeypatch.setattr(torch_compat, "stage_takes_mesh", lambda: True)  # the arithmetic, on any torch of the range
    with pytest.raises(PipelineConfigError, match=r"`tensor_parallel` must be 'auto' or an int >= 1 .* got 0"):
        PipelineParallelStrategy(tensor_parallel=0)
    with pytest.raises(PipelineConfigError, match=r"`tensor_parallel=2` needs `frontend='modules'`: torch's tracer"):
        PipelineParallelStrategy(tensor_parallel=2, frontend="trace")
    with pytest.raises(PipelineConfigError, match=r"`loss_parallel`.*True or False, got 'yes'"):
        PipelineSettings(loss_parallel="yes")  # type: ignore[arg-type]
    with pytest.raises(
        PipelineConfigError, match=r"world size \(6 processes\) is not divisible by `tensor_parallel=4`"
    ):
        resolve_pipeline_size(2, 6, 4)
    with pytest.raises(PipelineConfigError, match=r"not divisible by `pipeline_size=2` x `tensor_parallel=2`"):
        resolve_pipeline_size(2, 6, 2)
    settings = PipelineSettings(pipeline_size=2, tensor_parallel=2).resolve(8)
    assert (settings.tensor_parallel_size, settings.data_parallel_size, settings.pipeline_size) == (2, 2, 2)
    auto = PipelineSettings(tensor_parallel=4).resolve(8)  # "auto" pipeline: the processes left by tp
    assert (auto.pipeline_size, auto.data_parallel_size) == (2, 1)
    assert PipelineSettings().resolve(4).tensor_parallel_size == 1 and PipelineSettings().tensor_parallel == "auto"


def test_tensor_parallel_under_a_pipeline_is_refused_on_a_torch_without_dtensor_stages(monkeypatch):
    # torch 2.11 and 2.12: `PipelineStage` has no `get_mesh`, so a stage cannot rebuild a received DTensor.
    monkeypatch.setattr(torch_compat, "stage_takes_mesh", lambda: False)
    with pytest.raises(
        PipelineConfigError,
        match=r"`tensor_parallel=2` with `pipeline_size=2` needs torch 2.13 or newer \(this is torch "
        + re.escape(torch.__version__)
        + r"\).*Upgrade torch, or use `tensor_parallel=1`",
    ):
        resolve_pipeline_size(2, 4, 2)
    assert resolve_pipeline_size(1, 4, 2) == (1, 2)  # no pipeline: nothing crosses stages
    assert resolve_pipeline_size(2, 4, 1) == (2, 2)


def test_schedule_options_follow_the_torch_signature():
    class Old:  # torch 2.11's `step`: no `return_outputs`, no `loss_kwargs`
        def step(self, *args, target=None, losses=None, **kwargs): ...

    class New:  # torch 2.13's
        def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs): ...

    assert torch_compat.step_options(Old()) == {"return_outputs": False, "loss_kwargs": False}
    assert torch_compat.step_options(New()) == {"return_outputs": True, "loss_kwargs": True}
    assert step_options(Old()) == {} and step_options(New()) == {"return_outputs": False}


def test_the_norm_counts_each_part_once():
    whole = torch.ones(3)
    first, replica = counted_once({"dp": 0, "tp": 0}, ("dp", "tp")), counted_once({"dp": 1, "tp": 0}, ("dp", "tp"))
    other_tp = counted_once({"dp": 0, "tp": 1}, ("dp", "tp"))
    # A gradient whole on every rank (ddp, not tensor-parallel) is counted by rank (dp 0, tp 0) only.
    assert first(whole) and not replica(whole) and not other_tp(whole)
    # Summed over the pipeline only (no sharding anywhere): everything counts.
    assert counted_once({"dp": 1, "tp": 1}, ())(whole)


def test_gradient_summaries_differ_beyond_float_noise_only():
    assert not _differ(None, (4, 1.0, 1.0))
    assert not _differ((4, 1.0, 1.0), (4, 1.0 + 1e-9, 1.0 + 1e-9))
    assert _differ((4, 1.0, 1.0), (4, 0.5, 1.0)) and _differ((4, 1.0, 1.0), (4, 1.0, 0.7))


def test_retie_makes_replaced_parameters_one_again_and_refuses_other_layouts():
    net = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    net[1].weight = nn.Parameter(net[0].weight.detach().clone())  # parallelize_module replaced one of them
    retie(net, [("0.weight", "1.weight")])
    assert net[1].weight is net[0].weight
    retie(net, [("0.weight", "1.weight", "2.weight")])  # a name another stage holds is skipped
    net[1].weight = nn.Parameter(torch.zeros(5, 2))
    with pytest.raises(PipelineModelError, match=r"'0.weight' and '1.weight' are one parameter \(tied\), but tensor"):
        retie(net, [("0.weight", "1.weight")])


def test_a_memory_report_gives_the_tensor_parallel_share():
    report = MemoryReport(1, (0,), StateBytes(4096, 0, 0), {}, None, tensor_parallel=(1, 2, 3072))
    line = report.lines()[1]
    assert line.startswith("rank 1 is tensor-parallel rank 1 of 2: 3.00 KiB of its parameters are its 1/2 share")
    assert "(6.00 KiB in all); the other 1.00 KiB are held whole by each" in line


# ------------------------------------------------------------------------------------------------- DTensors, one rank
def test_dtensor_helpers_on_one_rank(one_rank):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh("tp")
    like = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    assert sharded_axes(like) == {"tp"} and sharded_axes(torch.zeros(1)) == set()
    whole = torch.arange(8.0).reshape(4, 2)
    assert torch.equal(place_like(whole, like).full_tensor(), whole)
    assign_whole_(like, whole)
    assert torch.equal(like.to_local(), whole)
    # A DTensor activation travels as its local part and its layout, and is rebuilt on the receiver's mesh.
    skeleton, tensors = transport.pack({"h": like, "n": 3})
    assert isinstance(transport.slots(skeleton)[0].layout, Layout) and not hasattr(tensors[0], "placements")
    rebuilt = transport.unpack(skeleton, tensors, lambda axes: mesh)
    assert rebuilt["n"] == 3 and rebuilt["h"].placements == (Shard(0),) and torch.equal(rebuilt["h"].to_local(), whole)
    # A gradient laid out otherwise than its parameter (a vocabulary-parallel embedding's comes back whole) is given
    # the parameter's layout before it is added.
    param = nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    stash = GradientStash()
    with stash.capture([param]):
        param.grad = distribute_tensor(torch.ones(4, 2), mesh, [Replicate()])
    stash.apply()
    assert param.grad.placements == (Shard(0),)
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    split_early = parallelize_module(nn.Sequential(nn.Linear(2, 4)), mesh, {"0": ColwiseParallel()})
    with pytest.raises(
        PipelineModelError,
        match=r"Parameters of Sequential \(0\.weight, 0\.bias\) are already DTensors.*tensor parallelism or FSDP"
        r".*before the strategy cut.*`configure_model`.*`data_parallel='fsdp'`",
    ):
        check_whole_before_split(split_early)


# ------------------------------------------------------------------------------------------------- Hugging Face plans
def _hf_llama(tie: bool = False, **overrides) -> nn.Module:
    from tests.hf_models import build

    model = build("llama", tie, layers=4)
    for key, value in overrides.items():
        setattr(model.config, key, value)
    return model


def test_hugging_face_plan_names_the_held_modules_and_their_styles():
    model = _hf_llama()
    plan = full_plan(model)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] in ("colwise_rep", "colwise_gather_output")
    del model.model.layers[:2]  # this rank holds blocks 2 and 3 (the cut deletes the others, keeping the names)
    chosen = hf_tensor_parallel_plan(model, 2)
    assert chosen["model.layers.0.self_attn.o_proj"] == "rowwise"
    # The embedding follows the model's own plan: 4.x and early 5.x leave an untied one whole, later 5.x (5.24) plan it
    # split over the vocabulary.
    assert plan.get("model.embed_tokens") in (("embedding_rowwise", None) if _transformers_5() else (None,))
    assert chosen.get("model.embed_tokens") == plan.get("model.embed_tokens")
    assert sum(style == "colwise" for style in chosen.values()) == 2 * 5 and chosen["lm_head"] == plan["lm_head"]
    tied = _hf_llama(tie=True)
    chosen = hf_tensor_parallel_plan(tied, 2, [("model.embed_tokens.weight", "lm_head.weight")])
    # The tied embedding is split over the vocabulary, like its head.
    assert chosen["model.embed_tokens"] in ("vocab_parallel_embedding", "embedding_rowwise")


def test_hugging_face_plan_errors():
    with pytest.raises(PipelineModelError, match=r"LlamaForCausalLM has no tensor-parallel plan .*base_model_tp_plan"):
        hf_tensor_parallel_plan(_hf_llama(base_model_tp_plan=None), 2)
    with pytest.raises(PipelineConfigError, match=r"`tensor_parallel=4` does not divide `num_key_value_heads=2`"):
        hf_tensor_parallel_plan(_hf_llama(), 4)
    moe = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.experts": "grouped_gemm"}
    with pytest.raises(PipelineModelError, match=r"uses styles lightning-pipe does not apply .*'grouped_gemm'"):
        hf_tensor_parallel_plan(_hf_llama(base_model_tp_plan=moe), 2)


# ---------------------------------------------------------------------------------------------------- references
def _fit_reference(model, **trainer_kwargs) -> dict:
    import lightning.pytorch as L

    from tests.models import quiet_trainer

    norms: list[float] = []

    class Norms(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # before Lightning clips
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()])))

    trainer = quiet_trainer(devices=1, callbacks=[Norms()], **trainer_kwargs)
    trainer.fit(model)
    # A tied parameter under its first name only, as checkpoints and the pipeline's snapshots name it.
    seen: set[int] = set()
    state = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            state[k] = v.detach().float().clone()
    return {"losses": model.step_losses, "val": getattr(model, "val_losses", []), "state": state, "norms": norms}


@functools.cache
def decoder_reference() -> dict:
    import lightning.pytorch as L

    from tests.tp_models import LitTPDecoder

    L.seed_everything(0)
    return _fit_reference(
        LitTPDecoder(), max_steps=4, gradient_clip_val=CLIP, val_check_interval=2, limit_val_batches=2
    )


@functools.cache
def replicas_reference() -> dict:
    """One device fed what the 2 data-parallel replicas see (their DistributedSampler shards, concatenated)."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from tests.decoder_models import padded_dataset
    from tests.reference import ReplicaBatches
    from tests.tp_models import LitTPDecoder

    L.seed_everything(0)
    model = LitTPDecoder(weighted=False)
    data = padded_dataset(64, seed=0)
    batches = ReplicaBatches(len(data), 2, 8)
    model.train_dataloader = lambda: DataLoader(data, batch_sampler=batches)
    return _fit_reference(model, max_steps=3, gradient_clip_val=CLIP, accumulate_grad_batches=2, limit_val_batches=0)


@functools.cache
def hf_reference(family: str, tied: bool) -> dict:
    import lightning.pytorch as L

    from tests.hf_models import LitHF

    L.seed_everything(0)
    return _fit_reference(LitHF(family=family, tie=tied, layers=4), max_steps=4, gradient_clip_val=CLIP)


# ---------------------------------------------------------------------------------------------------- launches
def _four_configs(out) -> list[dict]:
    if not torch_compat.stage_takes_mesh():
        return []  # the fixture skips
    # transformers 5 plans Qwen3's per-head norms; 4.x leaves them out (an error)
    return [{**c, "error": False} if c["name"] == "hf-qwen3" and _transformers_5() else c for c in FOUR]


def _write_pretrained(out) -> None:
    """The Hugging Face directories the "init" scenarios read, in the launch's folder."""
    for name, network in _pretrained().items():
        if name == "llama-hf":
            network.save_pretrained(out / name, max_shard_size="40KB")  # several files
        else:
            _save_safetensors(network, out / name)


SHARED_FOUR.part(__name__, "four", "tensor_parallel.py", _four_configs, timeout=1500, prepare=_write_pretrained)


@pytest.fixture(scope="module")
def four(request) -> Launch:
    _needs_dtensor_stages()
    return SHARED_FOUR.launch(request)  # the 4-process launch shared with other modules (tests/launch.py Shared)


def _needs_dtensor_stages() -> None:
    if not torch_compat.stage_takes_mesh():
        pytest.skip(
            f"tensor parallelism under a pipeline needs torch 2.13 or newer (this is torch {torch.__version__})"
        )


def _pretrained() -> dict:
    """The networks the "init" scenarios start from (seed 1: not what the scenario's own construction draws)."""
    from tests.hf_models import build
    from tests.tp_models import TPDecoder

    torch.manual_seed(1)
    decoder = TPDecoder(n_layers=8, tied=True)
    torch.manual_seed(1)
    return {"decoder-hf": decoder, "llama-hf": build("llama", True, 4)}


def _save_safetensors(network, directory) -> None:
    from safetensors.torch import save_model

    directory.mkdir()
    save_model(network, str(directory / "model.safetensors"))  # the tied head stored once


@pytest.fixture(scope="module")
def eight(tmp_path_factory) -> Launch:
    _needs_dtensor_stages()
    out = tmp_path_factory.mktemp("tp8")
    return run_scenarios("tensor_parallel.py", out, EIGHT, nprocs=8, launcher="torchrun", timeout=1500)


def _merged(ranks: list[dict], which: str = "end") -> dict:
    """Every rank's whole tensors of one data-parallel replica; equal where ranks share a name (tensor-parallel peers,
    tied copies)."""
    merged: dict = {"state": {}, "optim": {}}
    for r in ranks:
        if r["ranks"]["dp"] != 0:
            continue
        for part in merged:
            for key, value in r[which][part].items():
                if key in merged[part] and isinstance(value, torch.Tensor):
                    assert torch.equal(merged[part][key], value), f"{key} differs between ranks"
                merged[part][key] = value
    return merged


def _assert_parity(ranks: list[dict], ref: dict, replicas: int = 1) -> None:
    losses = {}
    for r in ranks:
        losses.setdefault(r["ranks"]["dp"], r["losses"])
    # Each replica logs its own batches' loss; their mean is the one device's on the concatenated batch.
    mean = torch.tensor(list(losses.values())).mean(0)
    assert len(losses) == replicas
    torch.testing.assert_close(mean, torch.tensor(ref["losses"]), rtol=TOL, atol=0)
    state = _merged(ranks)["state"]
    assert state.keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(state[key], value, rtol=TOL, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
    if ref["val"]:
        for r in ranks:
            torch.testing.assert_close(torch.tensor(r["val_losses"]), torch.tensor(ref["val"]), rtol=TOL, atol=0)


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "zbv-ac", "interleaved", "sequence", "dtensor"])
def test_decoder_with_the_users_plan_equals_one_device(four, name):
    ref = decoder_reference()
    assert all(n > CLIP for n in ref["norms"]), "clipping is active in every step"
    ranks = four.ranks(name)
    _assert_parity(ranks, ref)
    # pp outermost, tp innermost: each pipeline joins the same tensor-parallel rank of both stages.
    assert [r["ranks"]["tp_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ranks"]["pp_group"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # The memory report gives each rank's tensor-parallel share.
    for r in ranks:
        share = [line for line in r["memory"] if "is tensor-parallel rank" in line]
        assert share and f"tensor-parallel rank {r['ranks']['tp']} of 2" in share[0], r["memory"]


@pytest.mark.extended
@pytest.mark.slow
def test_checkpoint_resumes_exactly_and_reshards(four):
    saved = _merged(four.ranks("ck-save"))
    resumed, straight = four.ranks("ck-resume"), four.ranks("ck-straight")
    # Weights and optimizer state (Adam's moments, tensor-parallel shards gathered) as saved, bitwise.
    for which in (resumed, four.ranks("ck-reshard")):
        start = _merged(which, "start")
        for part in ("state", "optim"):
            assert start[part].keys() == saved[part].keys() and start[part]
            for key, value in saved[part].items():
                assert (
                    torch.equal(start[part][key], value)
                    if isinstance(value, torch.Tensor)
                    else start[part][key] == value
                ), key
    # Resumed at pp2 x tp2, training continues as if never interrupted.
    for r, s in zip(resumed, straight):
        assert r["losses"] == s["losses"][2:]
    assert _merged(resumed)["state"].keys() == _merged(straight)["state"].keys()
    for key, value in _merged(straight)["state"].items():
        assert torch.equal(_merged(resumed)["state"][key], value), key
    reshard = four.ranks("ck-reshard")
    assert sorted(r["ranks"]["dp"] for r in reshard) == [0, 0, 1, 1] and {r["ranks"]["tp"] for r in reshard} == {0}
    manifest = json.loads((four.out / "tp.ckpt" / "lightning_pipe.json").read_text())
    assert manifest["tensor_parallel_size"] == 2 and manifest["tied_aliases"] == {
        "model.head.weight": "model.embed.weight"
    }


@pytest.mark.extended
@pytest.mark.slow
def test_checkpoint_resumes_on_one_device(four, tmp_path):
    """The pp2 x tp2 checkpoint into one process (the strategy with one stage), and consolidated into one file that
    plain Lightning resumes: weights and optimizer state equal."""
    import lightning.pytorch as L

    from lightning_pipe.checkpoint import convert
    from lightning_pipe.checkpoint import optim as ckpt_optim
    from tests.models import quiet_trainer
    from tests.tp_models import LitTPDecoder

    saved = _merged(four.ranks("ck-save"))
    starts = []

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            names = ckpt_optim.param_names(pl_module, {"model.head.weight": "model.embed.weight"})
            flat = ckpt_optim.flatten(opt, names)  # the optimizer's own tensors: copied, the run goes on
            flat = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
            starts.append(({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, flat))

    single = convert.consolidate(
        four.out / "tp.ckpt", tmp_path / "single.ckpt", with_optimizer=True, weights_only=False
    )
    for strategy, path in ((PipelineParallelStrategy(), four.out / "tp.ckpt"), ("auto", single)):
        L.seed_everything(0)
        model = LitTPDecoder(optimizer="adam", samples=16, shuffle=False)
        trainer = quiet_trainer(devices=1, max_steps=3, strategy=strategy, callbacks=[Start()])
        trainer.fit(model, ckpt_path=str(path))
    for state, optim in starts:
        assert all(torch.equal(state[k].float(), v) for k, v in saved["state"].items())
        assert "model.head.weight" in state  # one device names the tied parameter twice
        assert {k for k in saved["optim"] if k.startswith("state.")} == {k for k in optim if k.startswith("state.")}
        for key, value in saved["optim"].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(optim[key].float(), value), key


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["init-dir", "hf-init-dir", "pretrained-dir"])
def test_initial_weights_from_a_hugging_face_directory_are_split(four, name):
    """``init_weights=<directory>`` at pp2 x tp2: the user's DTensor parameters (decoder) and the parameters the model's
    own plan splits after the load (Llama, built in ``__init__`` or from the directory's config in ``configure_model``)
    start from the directory's tensors, bitwise, on every rank."""
    ranks = four.ranks(name)
    expected = {
        f"model.{k}": v
        for k, v in _pretrained()["decoder-hf" if name == "init-dir" else "llama-hf"].state_dict().items()
    }
    start = _merged(ranks, "start")["state"]
    assert start and set(start) <= set(expected)
    for key, value in start.items():
        assert torch.equal(value, expected[key]), key
    # And the parameters are split: each rank holds a share.
    for r in ranks:
        assert any("is tensor-parallel rank" in line for line in r["memory"]), r["memory"]


@pytest.mark.extended
@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_exports_to_hugging_face(four, tmp_path):
    """export-hf of the pp2 x tp2 checkpoint (tied Llama, split by its own plan): ``from_pretrained`` gives the
    trained weights."""
    from transformers import AutoModelForCausalLM

    from lightning_pipe.checkpoint import export

    trained = _merged(four.ranks("hf-llama-tied"))["state"]
    out = export.export(four.out / "hf-tp.ckpt", tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()  # still tied
    for key, value in trained.items():
        assert torch.equal(loaded[key.removeprefix("model.")].float(), value), key


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-llama", "hf-llama-tied", "hf-qwen3"])
def test_hugging_face_models_parallelised_by_their_own_plan(four, name):
    ranks = four.ranks(name)
    if name == "hf-qwen3" and not _transformers_5():
        error = {r["error"] for r in ranks}
        assert len(error) >= 1 and all(kind == "PipelineModelError" for kind, _ in error)
        assert all("q_norm.weight" in message and "replicated_with_grad_allreduce" in message for _, message in error)
        return
    family, tied = ("qwen3", False) if name == "hf-qwen3" else ("llama", name.endswith("tied"))
    _assert_parity(ranks, hf_reference(family, tied))


ERRORS = {
    "err-tie-layouts": ("PipelineModelError", "The copies of the tied parameter 'model.embed.weight' on different"),
    "err-retie": ("PipelineModelError", "'embed.weight' and 'head.weight' are one parameter (tied), but tensor"),
    "err-foreign-mesh": ("PipelineModelError", "is split over a device mesh with axes ('tp',) and ranks [0, 1, 2, 3]"),
    "err-no-plan": ("PipelineConfigError", "`tensor_parallel=2` but no parameter of TPDecoder is split over the 'tp'"),
    "err-split-late": ("PipelineModelError", "are already DTensors (tensor parallelism or FSDP applied) before the"),
    "err-whole-gradients": ("PipelineModelError", "'model.blocks.0.q_norm.weight', 'model.blocks.1.q_norm.weight'"),
}


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_are_raised_alike_on_every_rank(four, name):
    kind, fragment = ERRORS[name]
    ranks = four.ranks(name)
    assert len(ranks) == 4
    assert all(r["error"][0] == kind for r in ranks), [r["error"] for r in ranks]
    assert fragment in ranks[0]["error"][1]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_pipeline_tensor_and_data_parallel_equal_one_device(eight, name):
    ref = replicas_reference()
    assert all(n > CLIP for n in ref["norms"])
    ranks = eight.ranks(name)
    _assert_parity(ranks, ref, replicas=2)
    # Both replicas end with the same weights.
    replica = _merged([{**r, "ranks": {**r["ranks"], "dp": 0}} for r in ranks if r["ranks"]["dp"] == 1])["state"]
    assert all(torch.equal(replica[k], v) for k, v in _merged(ranks)["state"].items())
    assert [r["ranks"]["tp_group"] for r in ranks][:4] == [[0, 1], [0, 1], [2, 3], [2, 3]]
