"""``Fabric(strategy="pipeline")``: a Fabric loop (``tests/fabric_loop.py``) against ``Fabric(devices=1)``, and the
errors a Fabric loop gets for what cannot run under a pipeline."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric, seed_everything
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_pipe
from lightning_pipe.errors import PipelineCheckpointError, PipelineConfigError, PipelineUsageError
from tests.fabric_loop import VOCAB, LitGPT2, build_gpt, build_litgpt, dataset, train, train_litgpt
from tests.gpt2 import GPT2
from tests.launch import Launch, run_scenarios
from tests.models import quiet_trainer

CLIP = 0.5
LITGPT = {"model": "litgpt", "frontend": "dataflow", "devices": 2, "accumulate": 2, "clip": CLIP}
CONFIGS = [
    {"name": "1F1B-acc2-clip", "schedule": "1F1B", "devices": 2, "accumulate": 2, "clip": CLIP},
    {"name": "ZBV-acc2-clip", "schedule": "ZBVZeroBubble", "devices": 2, "accumulate": 2, "clip": CLIP},
    # By the registry's name, with every default, the model built on the meta device.
    {"name": "by-name-meta", "by_name": True, "devices": 2, "meta": True},
    # litgpt's GPT in litgpt's fine-tune loop: its chunked cross-entropy, `lm_head_chunk_size`, its rope cache.
    {**LITGPT, "name": "litgpt-1F1B-acc2-clip", "schedule": "1F1B"},
    {**LITGPT, "name": "litgpt-ZBV-acc2-clip-chunks", "schedule": "ZBVZeroBubble", "chunk": 4},
    {**LITGPT, "name": "litgpt-meta", "schedule": "1F1B", "meta": True},
    # litgpt's LoRA fine-tune: `litgpt.lora.GPT`, its base frozen (a smaller clip: LoRA's gradients are small).
    *(
        {**LITGPT, "name": f"litgpt-lora-{s}-acc2-clip", "schedule": s, "lora": True, "clip": 0.1}
        for s in ("1F1B", "ZBVZeroBubble")
    ),
    # Fabric's precision plugins: compared with Fabric(devices=1) at the same precision, to that precision's tolerance.
    *(
        {"name": f"{p}-1F1B-acc2-clip", "schedule": "1F1B", "devices": 2, "accumulate": 2, "clip": CLIP, "precision": p}
        for p in ("bf16-mixed", "bf16-true")
    ),
]
#: bfloat16 matmuls (and weights): gradients summed per microbatch round differently. Losses and clip norms to
#: bfloat16's own tolerance; weights within a fraction of the tensor's largest entry (bfloat16's ulp is 2**-8 of it:
#: measured 2**-5.6 for bf16-true's bfloat16 weights after 4 steps, under 2**-7 for bf16-mixed's float32 weights)
TOLERANCE = {"bf16-mixed": {"rtol": 1.6e-2, "atol": 1e-5}, "bf16-true": {"rtol": 1.6e-2, "atol": 1e-5}}
WEIGHTS_ATOL = {"bf16-mixed": 2**-7, "bf16-true": 2**-4}


#: litgpt's full fine-tune as its script runs at 2 processes: the model built with `empty_init`, its weights loaded by
#: its own strict `load_checkpoint` of the whole model (or `fabric.load_raw`), SFT-padded targets, the step returning
#: `num_items`. The reference is the same script under Fabric(devices=1), without `num_items`.
LOADED = [
    {**LITGPT, "name": "litgpt-load-checkpoint", "schedule": "1F1B", "checkpoint": "litgpt.pth", "raw": False},
    {**LITGPT, "name": "litgpt-load-raw-ZBV", "schedule": "ZBVZeroBubble", "checkpoint": "litgpt.pth", "raw": True},
]
LOADED = [{**cfg, "meta": True, "sft": True, "weighted": True} for cfg in LOADED]

#: save after step 2 of 4, then continue from it in a fresh model and optimizer (the same launch)
SAVED = {"name": "ckpt-full", "schedule": "1F1B", "devices": 2, "save_at": 2}
RESUMED = {"name": "ckpt-resumed", "schedule": "1F1B", "devices": 2, "resume": "ckpt-full"}
#: a one-process Trainer's checkpoint after step 2 (``trainer-ckpt``, written before the launch) continued by Fabric
FROM_TRAINER = {"name": "from-trainer", "schedule": "1F1B", "devices": 2, "resume": "trainer"}


@functools.cache
def _reference(
    model: str, accumulate: int, clip: float | None, meta: bool, chunk: int, lora: bool, precision: str
) -> tuple:
    """The loop under ``Fabric(devices=1)``; with ``meta``, under a one-process pipeline (a model built with
    ``empty_init=True`` is initialised per unit there, the same whatever the layout)."""
    cfg = {"accumulate": accumulate, "clip": clip, "meta": meta, "chunk": chunk, "lora": lora}
    loop = train_litgpt if model == "litgpt" else train
    if meta:
        frontend = "dataflow" if model == "litgpt" else "auto"
        fabric = Fabric(strategy=lightning_pipe.PipelineFabricStrategy(frontend=frontend), accelerator="cpu", devices=1)
        fabric.launch()
        return loop(fabric, cfg, pipelined=True)
    return loop(Fabric(accelerator="cpu", devices=1, precision=precision), cfg, pipelined=False)


# Each launch once per module: each test reads its own configurations' outcomes (Launch.ranks).
@pytest.fixture(scope="module")
def two_procs(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("fabric2")
    seed_everything(0)  # the Fabric loop's start weights
    trainer = quiet_trainer(devices=1, max_steps=2, strategy=lightning_pipe.PipelineParallelStrategy())
    trainer.fit(LitGPT2(0, 2))
    trainer.save_checkpoint(out / "trainer-ckpt")
    torch.manual_seed(7)  # weights unlike the loop's own start
    torch.save(build_litgpt(Fabric(accelerator="cpu", devices=1)).state_dict(), out / "litgpt.pth")
    configs = [*CONFIGS, SAVED, RESUMED, FROM_TRAINER, *LOADED]
    return run_scenarios("fabric_parity.py", out, configs, nprocs=2, launcher="lightning")


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c["name"])
def test_two_process_fabric_loop_matches_one_device(two_procs, cfg):
    ranks = two_procs.ranks(cfg["name"])
    losses, weights, norms = _reference(
        cfg.get("model", "gpt"),
        cfg.get("accumulate", 1),
        cfg.get("clip"),
        cfg.get("meta", False),
        cfg.get("chunk", 0),
        cfg.get("lora", False),
        cfg.get("precision", "32-true"),
    )
    tolerance = TOLERANCE.get(cfg.get("precision"), {"rtol": 1e-5, "atol": 1e-7})
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        # Every rank gets the step's loss (and the clip's global norm).
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), **tolerance)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(norms), **tolerance)
        assert not merged.keys() & r["weights"].keys(), "each rank holds only its own stages"
        merged.update(r["weights"])
    assert merged.keys() == weights.keys()
    for key, value in weights.items():
        assert merged[key].dtype == value.dtype, key
        fraction = WEIGHTS_ATOL.get(cfg.get("precision"))
        atol = fraction * float(value.abs().max()) if fraction else tolerance["atol"]
        torch.testing.assert_close(
            merged[key], value, rtol=tolerance["rtol"], atol=atol, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert sorted(s for r in ranks for s in r["stages"]) == list(
        range(4 if cfg.get("schedule") == "ZBVZeroBubble" else 2)
    )
    if cfg.get("clip"):
        assert max(norms) > cfg["clip"], "the clip is active in the reference"
    if cfg.get("lora"):  # the frozen base: bitwise its start weights (the reference's, which no optimizer holds)
        frozen = [k for k in weights if "lora_" not in k]
        assert frozen and all(torch.equal(merged[k], weights[k]) for k in frozen)


# In the launch of the 2-process Fabric loops (extended): 2 more configurations of it
@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("cfg", LOADED, ids=lambda c: c["name"])
def test_litgpt_loop_with_its_own_strict_load_checkpoint_matches_one_device(two_procs, cfg):
    reference = {**cfg, "meta": False, "checkpoint": str(two_procs.out / cfg["checkpoint"])}
    losses, weights, norms = train_litgpt(Fabric(accelerator="cpu", devices=1), reference, pipelined=False)
    saved = torch.load(two_procs.out / cfg["checkpoint"])
    ranks = two_procs.ranks(cfg["name"])
    merged = {k: v for r in ranks for k, v in r["weights"].items()}
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(norms), rtol=1e-5, atol=1e-7)
    assert merged.keys() == weights.keys() == saved.keys()
    for key, value in weights.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
    assert not torch.equal(weights["lm_head.weight"], saved["lm_head.weight"]), "the loop trained from the file"


def test_litgpt_under_the_modules_frontend_is_refused_by_name():
    # The default frontend ("auto") picks the dataflow frontend for litgpt's GPT; "modules" is refused by name.
    strategy = lightning_pipe.PipelineFabricStrategy(frontend="modules")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    with pytest.raises(
        PipelineConfigError, match=r"litgpt's GPT.*forward whole.*every stage.*`frontend='dataflow'`"
    ) as e:
        fabric.setup_module(build_litgpt(fabric))
    assert "does not take `tensor_parallel > 1`, so a litgpt GPT is pipelined without tensor parallelism" in str(
        e.value
    )


#: 2 pipelines of 2 stages; the global batch of 16 shared out by the sampler, as one device's batch of 16
DATA_PARALLEL = [
    {"name": f"dp2-pp2-{mode}", "schedule": "1F1B", "devices": 4, "pipeline_size": 2, "data_parallel": mode}
    | {"accumulate": 2, "clip": CLIP, "batch": 16, "replicas": 2}
    for mode in ("ddp", "fsdp")
] + [
    # one pipeline of 4 processes, 2 stages each
    {"name": "pp4-interleaved", "schedule": "Interleaved1F1B", "devices": 4, "n_layer": 8, "data_parallel": "ddp"}
    | {"accumulate": 2, "clip": CLIP}
]
#: litgpt's LoRA fine-tune likewise: 2 x 2 under DDP and FSDP, and one pipeline of 4 processes
DATA_PARALLEL += [
    {**cfg, "name": f"litgpt-lora-{cfg['name']}", "model": "litgpt", "frontend": "dataflow", "lora": True, "clip": 0.1}
    for cfg in DATA_PARALLEL
]


#: token-weighted steps accumulated inside `fabric.no_backward_sync` under FSDP: refused (last: it ends the launch)
FSDP_WEIGHTED_WINDOW = {**DATA_PARALLEL[1], "name": "dp2-pp2-fsdp-weighted", "weighted": True}


@pytest.fixture(scope="module")
def four_procs(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("fabric4")
    configs = [*DATA_PARALLEL, FSDP_WEIGHTED_WINDOW]
    return run_scenarios("fabric_parity.py", out, configs, nprocs=4, launcher="lightning")


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp_refuses_token_weighted_steps_inside_no_backward_sync(four_procs):
    assert FSDP_WEIGHTED_WINDOW["data_parallel"] == "fsdp" and FSDP_WEIGHTED_WINDOW["accumulate"] == 2
    for rank in four_procs.ranks(FSDP_WEIGHTED_WINDOW["name"]):
        error = rank["error"]
        assert "`data_parallel='fsdp'` with `fabric.no_backward_sync` cannot weight" in error, error


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("cfg", DATA_PARALLEL, ids=lambda c: c["name"])
def test_four_processes_match_one_device_on_the_global_batch(four_procs, cfg):
    ranks = four_procs.ranks(cfg["name"])
    fabric = Fabric(accelerator="cpu", devices=1)
    reference = {"accumulate": 2, "clip": cfg["clip"], "batch": cfg.get("batch", 8), "n_layer": cfg.get("n_layer", 4)}
    loop = train_litgpt if cfg.get("model") == "litgpt" else train
    losses, weights, norms = loop(fabric, reference | {"lora": cfg.get("lora", False)}, pipelined=False)
    assert max(norms) > cfg["clip"], "the clip is active in the reference"
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(norms), rtol=1e-5, atol=1e-7)
    if cfg["data_parallel"] == "fsdp":
        return  # FSDP's weights are shards (DTensors): losses and clip norms compared above
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        for key, value in r["weights"].items():
            # The replicas of a stage hold bitwise equal weights.
            assert key not in merged or torch.equal(merged[key], value), key
            merged[key] = value
    assert merged.keys() == weights.keys()
    for key, value in weights.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
    if cfg.get("lora"):  # the frozen base: bitwise its start weights
        frozen = [k for k in weights if "lora_" not in k]
        assert frozen and all(torch.equal(merged[k], weights[k]) for k in frozen)


@pytest.mark.extended
@pytest.mark.slow
def test_fabric_checkpoint_continues_bitwise(two_procs):
    for full, resumed in zip(two_procs.ranks("ckpt-full"), two_procs.ranks("ckpt-resumed")):
        assert resumed["losses"] == full["losses"][2:]
        assert resumed["weights"].keys() == full["weights"].keys()
        assert all(torch.equal(resumed["weights"][k], v) for k, v in full["weights"].items())
    assert (two_procs.out / "ckpt-full-ckpt" / "lightning_pipe.json").is_file()  # the Trainer strategy's format


@pytest.mark.extended
@pytest.mark.slow
def test_fabric_checkpoint_loads_into_another_layout(two_procs):
    """The 2-process checkpoint continues in a one-process pipeline (every stage on one rank)."""
    fabric = Fabric(strategy="pipeline", accelerator="cpu", devices=1)
    fabric.launch()
    losses, weights, _ = train(
        fabric, {"steps": 4, "resume_from": str(two_procs.out / "ckpt-full-ckpt")}, pipelined=True
    )
    full = two_procs.ranks("ckpt-full")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full[0]["losses"][2:]), rtol=1e-5, atol=1e-7)
    merged = {**full[0]["weights"], **full[1]["weights"]}
    for key, value in merged.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-7)


@pytest.mark.extended
@pytest.mark.slow
def test_trainer_checkpoint_continues_under_fabric_in_another_layout(two_procs):
    """A one-process Trainer's checkpoint continues in the two-process Fabric loop: as the uninterrupted run."""
    full = two_procs.ranks("ckpt-full")
    for rank in two_procs.ranks("from-trainer"):
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(full[0]["losses"][2:]), rtol=1e-5, atol=0)
    merged = {k: v for r in two_procs.ranks("from-trainer") for k, v in r["weights"].items()}
    for key, value in {**full[0]["weights"], **full[1]["weights"]}.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-7)


@pytest.mark.extended
@pytest.mark.slow
def test_fabric_checkpoint_continues_under_the_trainer_in_another_layout(two_procs):
    """The two-process Fabric checkpoint continues under the Trainer strategy in a one-process pipeline."""
    module = LitGPT2(2, 4)
    trainer = quiet_trainer(devices=1, max_steps=2, strategy=lightning_pipe.PipelineParallelStrategy())
    with pytest.warns(UserWarning, match="no resume point"):
        trainer.fit(module, ckpt_path=two_procs.out / "ckpt-full-ckpt")
    full = two_procs.ranks("ckpt-full")
    torch.testing.assert_close(torch.tensor(module.step_losses), torch.tensor(full[0]["losses"][2:]), rtol=1e-5, atol=0)
    for key, value in {**full[0]["weights"], **full[1]["weights"]}.items():
        torch.testing.assert_close(module.model.state_dict()[key], value, rtol=1e-5, atol=1e-7)


def test_registered_in_fabric_registry():
    assert STRATEGY_REGISTRY["pipeline"]["strategy"] is lightning_pipe.PipelineFabricStrategy


# ---------------------------------------------------------------------------------------------- errors, one process
@pytest.fixture(scope="module")
def fabric():
    fabric = Fabric(strategy="pipeline", accelerator="cpu", devices=1)
    fabric.launch()
    return fabric


@pytest.fixture(scope="module")
def set_up(fabric):
    model = fabric.setup_module(build_gpt(fabric))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = dataset(1).tensors

    def forward_and_loss(batch):
        logits = model(batch[0])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))

    return model, optimizer, (x, y), forward_and_loss


def test_loss_backward_outside_fabric_backward_is_refused(fabric, set_up):
    model, _, batch, fn = set_up
    loss = model.step(fn, batch)
    with pytest.raises(PipelineUsageError, match=r"`loss.backward\(\)`.*call `fabric.backward\(loss\)`"):
        loss.backward()
    fabric.backward(loss)  # the step's gradients are still handed over


def test_backward_once_per_step(fabric, set_up):
    model, optimizer, batch, fn = set_up
    loss = model.step(fn, batch)
    fabric.backward(loss / 2)
    with pytest.raises(PipelineUsageError, match=r"once per step.*`loss = model.step\(fn, batch\)`"):
        fabric.backward(loss / 2)
    optimizer.zero_grad()


def test_second_step_before_backward_is_refused(fabric, set_up):
    model, optimizer, batch, fn = set_up
    loss = model.step(fn, batch)
    with pytest.raises(PipelineUsageError, match=r"called again before `fabric.backward\(loss\)`"):
        model.step(fn, batch)
    fabric.backward(loss * 0)
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters() if p.grad is not None)
    optimizer.zero_grad()


def test_backward_of_a_tensor_without_the_loss_is_refused(fabric, set_up):
    model, optimizer, batch, fn = set_up
    model.step(fn, batch)
    other = torch.ones((), requires_grad=True) * 2
    with pytest.raises(
        PipelineUsageError, match=r"`fabric\.backward`.*not depend on.*loss.*`model\.step\(fn, batch\)`.*Pass that loss"
    ):
        fabric.backward(other)
    optimizer.zero_grad()


def test_model_call_outside_the_step_is_refused(set_up):
    model, _, batch, _ = set_up
    with pytest.raises(PipelineUsageError, match=r"\(GPT2\) was called outside `model.step\(fn, batch\)`"):
        model(batch[0])


def test_evaluate_runs_forward_only(fabric, set_up):
    model, _, batch, fn = set_up
    value = model.evaluate(fn, batch)
    assert value.dim() == 0 and not value.requires_grad


def test_save_of_another_module_is_refused(fabric, set_up, tmp_path):
    model, optimizer, _, _ = set_up
    with pytest.raises(
        PipelineUsageError,
        match=r"`fabric\.save`/`fabric\.load`.*one model set up.*`fabric\.setup_module`.*\['model', 'other'\]",
    ):
        fabric.save(tmp_path / "ckpt", {"model": model, "other": torch.nn.Linear(2, 2), "optimizer": optimizer})
    with pytest.raises(PipelineUsageError, match=r"`fabric.save\(..., filter=...\)`.*Remove them"):
        fabric.save(tmp_path / "ckpt", {"model": model}, filter={"model": lambda k, v: True})


def test_load_of_a_missing_value_is_refused(fabric, set_up, tmp_path):
    model, optimizer, _, _ = set_up
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    state = {"model": model, "optimizer": optimizer, "step": 0, "epoch": 1}
    with pytest.raises(PipelineCheckpointError, match=r"has no \['epoch'\].*strict=False"):
        fabric.load(tmp_path / "ckpt", state)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(tmp_path / "ckpt", state) == {} and state["step"] == 3


def test_load_raw_of_a_whole_state_dict_file_goes_through_load_state_dict(fabric, set_up, tmp_path):
    model = set_up[0]
    torch.manual_seed(3)
    source = GPT2(vocab=VOCAB, block_size=16, n_layer=4, n_head=2, n_embd=32).state_dict()
    torch.save(source, tmp_path / "weights.pt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({**source, "h.9.attn.weight": torch.zeros(1)}, tmp_path / "unknown.pt")
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*h\.9\.attn\.weight"):
        fabric.load_raw(tmp_path / "unknown.pt", model)
    fabric.load_raw(tmp_path / "weights.pt", model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())
    model.load_state_dict(before)  # the module-scoped model as the other tests found it


def test_clip_by_another_norm_is_refused(fabric, set_up):
    model, optimizer, _, _ = set_up
    with pytest.raises(PipelineConfigError, match=r"norm_type=1.0.*Use `norm_type=2`"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=1.0)


def test_optimizer_set_up_with_the_model_is_refused():
    fabric = Fabric(strategy="pipeline", accelerator="cpu", devices=1)
    fabric.launch()
    model = build_gpt(fabric)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PipelineUsageError, match=r"`fabric.setup\(model, optimizer\)` cannot be used.*setup_module"):
        fabric.setup(model, optimizer)
    with pytest.raises(
        PipelineUsageError,
        match=r"optimizer was set up.*before the model.*model first.*`model = fabric\.setup_module\(model\)`",
    ):
        fabric.setup_optimizers(optimizer)


def test_optimizer_made_before_the_split_is_refused():
    fabric = Fabric(strategy="pipeline", accelerator="cpu", devices=1)
    fabric.launch()
    model = build_gpt(fabric)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    model = fabric.setup_module(model)
    # A one-stage pipeline keeps every parameter: the check is by identity, here against a copy's parameters.
    other = torch.optim.SGD(build_gpt(fabric).parameters(), lr=0.1)
    with pytest.raises(
        PipelineUsageError, match=r"optimizer holds \d+ parameters.*not this rank's stages.*`fabric\.setup_module`"
    ):
        fabric.setup_optimizers(other)
    fabric.setup_optimizers(stale)  # the same parameter objects: accepted
    fabric.strategy.teardown()


def test_init_weights_loads_each_rank_stages(tmp_path):
    torch.manual_seed(7)
    source = GPT2(vocab=VOCAB, block_size=16, n_layer=4, n_head=2, n_embd=32)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    strategy = lightning_pipe.PipelineFabricStrategy(init_weights=tmp_path / "weights.pt")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    model = fabric.setup_module(build_gpt(fabric, meta=True))
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    fabric.strategy.teardown()
    assert "step" not in vars(model), "teardown takes model.step off the model"


def test_precision_with_a_gradient_scaler_is_refused():
    from lightning.fabric.plugins import MixedPrecision

    # On CPU, `precision="16-mixed"` becomes "bf16-mixed": the plugin is given (as on a GPU it would be made).
    fabric = Fabric(strategy="pipeline", accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu")])
    fabric.launch()
    with pytest.raises(PipelineConfigError, match=r"precision='16-mixed'.*gradient scaler.*`precision='bf16-mixed'`"):
        fabric.setup_module(build_gpt(fabric))
