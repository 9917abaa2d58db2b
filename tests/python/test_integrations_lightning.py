"""ampfuse.integrations.lightning with the real Lightning Trainer and Fabric (CPU).

Each run trains a tiny MLP for a few steps with gradient clipping and a fused optimizer and is
compared with the same loop written by hand with torch.optim.AdamW and torch's clip_grad_norm_
(both runs clip with torch's function on the same unscaled fp32 grads, so only the optimizers'
own arithmetic differs).
"""

import copy
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")

from ampfuse import GradScaler  # noqa: E402
from ampfuse.integrations.lightning import AmpfuseFabricPrecision, AmpfusePrecision  # noqa: E402
from ampfuse.optimizers import FusedAdamW  # noqa: E402

STEPS = 4
BATCH = 8
CLIP = 0.05
LR = 1e-2
# The step whose gradient gets an inf planted in it.
PLANTED = 1
AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
# FusedAdamW against torch's AdamW over STEPS fp32 steps on the same clipped grads: a few fp32
# ulps of the params, which are O(0.1-1) and move by about 0.03 (measured worst 3.0e-8).
PARAM_ATOL = 1e-7


@pytest.fixture(autouse=True)
def quiet_lightning():
    # Lightning warns about DataLoader workers and small logging intervals on every run.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(count=STEPS):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(count * BATCH, 8, generator=gen)
    y = torch.randn(count * BATCH, 1, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def loss_of(net, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(net(x).float(), y.float())


def reference_run(precision, init_scale):
    """The loop Lightning runs, by hand, with torch.optim.AdamW; returns the net and the grad
    norms before clipping."""
    net = make_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=precision == "16-mixed")
    norms = []
    for batch in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=AUTOCAST[precision]):
            loss = loss_of(net, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        scaler.step(optimizer)
        scaler.update()
    return net, norms


def assert_same_params(net, ref_net):
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach(), rtol=0, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def plugin_scaler(precision):
    # A small first scale: the reference's torch scaler and ours then overflow on no step.
    return GradScaler("cpu", init_scale=2.0**8) if precision == "16-mixed" else None


class TinyModule(L.LightningModule):
    def __init__(self, make_optimizer, plant_inf=False):
        super().__init__()
        self.net = make_net()
        self.make_optimizer = make_optimizer
        self.plant_inf = plant_inf
        self.snapshots = []  # params before the first step, then after every step
        self.skipped_flags = []  # optimizer.last_step_skipped after every step

    def training_step(self, batch, batch_idx):
        return loss_of(self.net, batch)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())

    def on_train_start(self):
        self.snapshots.append([p.detach().clone() for p in self.parameters()])

    def on_after_backward(self):
        if self.plant_inf and self.trainer.global_step == PLANTED:
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.snapshots.append([p.detach().clone() for p in self.parameters()])
        flag = getattr(self.trainer.optimizers[0], "last_step_skipped", None)
        self.skipped_flags.append(None if flag is None else bool(flag))


def fit(module, plugin, data=None, max_steps=STEPS, ckpt_path=None):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        gradient_clip_val=CLIP,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, batches() if data is None else data, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_trainer_clips_with_a_fused_optimizer(precision):
    """gradient_clip_val with FusedAdamW: Lightning's own MixedPrecision raises "does not allow
    for gradient clipping"; the plugin unscales, clips and steps like torch's AdamW."""
    ref_net, norms = reference_run(precision, init_scale=2.0**8)
    assert min(norms) > CLIP, "the run must actually clip for the comparison to mean anything"
    module = TinyModule(lambda params: FusedAdamW(params, lr=LR))
    fit(module, AmpfusePrecision(precision, device="cpu", scaler=plugin_scaler(precision)))
    assert_same_params(module.net, ref_net)


class ClipsTwice(TinyModule):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        for _ in range(2):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


def test_trainer_clipping_twice_in_a_step_unscales_once():
    """A configure_gradient_clipping that clips twice: the second clip must find the grads
    already unscaled (GradScaler refuses a second unscale_ before update()), and the next step
    must unscale again. Clipping an already clipped gradient again changes nothing."""
    ref_net, _ = reference_run("16-mixed", init_scale=2.0**8)
    module = ClipsTwice(lambda params: FusedAdamW(params, lr=LR))
    fit(module, AmpfusePrecision("16-mixed", device="cpu", scaler=plugin_scaler("16-mixed")))
    assert_same_params(module.net, ref_net)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_fabric_clips_with_a_fused_optimizer(precision):
    """fabric.clip_gradients with FusedAdamW: Fabric's own MixedPrecision raises "Gradient
    clipping is not implemented for optimizers handling the unscaling" under 16-mixed."""
    ref_net, _ = reference_run(precision, init_scale=2.0**8)
    plugin = AmpfuseFabricPrecision(precision, device="cpu", scaler=plugin_scaler(precision))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    model, optimizer = fabric.setup(net, FusedAdamW(net.parameters(), lr=LR))
    for batch in batches():
        optimizer.zero_grad()
        fabric.backward(loss_of(model, batch))
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
    assert_same_params(net, ref_net)


def test_trainer_16_mixed_scaler_skips_a_planted_inf():
    """Under 16-mixed the ampfuse.GradScaler finds the inf (unscaled for clipping first) and the
    fused step is skipped on the device; the next step updates again."""
    scaler = GradScaler("cpu", init_scale=2.0**8)
    module = TinyModule(lambda params: FusedAdamW(params, lr=LR), plant_inf=True)
    fit(module, AmpfusePrecision("16-mixed", device="cpu", scaler=scaler))
    assert_skipped_only_the_planted_step(module.snapshots)
    assert scaler.get_skipped_steps() == 1


@pytest.mark.parametrize(
    "precision, optimizer_options",
    [("bf16-mixed", {"skip_nonfinite": True}),
     ("bf16-true", {"master_weights": True, "skip_nonfinite": None})],
)
def test_bf16_run_skips_a_planted_inf(precision, optimizer_options):
    """No scaler exists under bf16; the fused optimizer skips the non-finite step itself when
    asked (skip_nonfinite=None checks bf16/fp16 params when no scaler drives the step; True
    checks fp32 params under autocast too) and counts it."""
    module = TinyModule(lambda params: FusedAdamW(params, lr=LR, **optimizer_options),
                        plant_inf=True)
    kwargs = {"device": "cpu"} if precision.endswith("mixed") else {}
    trainer = fit(module, AmpfusePrecision(precision, **kwargs))
    assert_skipped_only_the_planted_step(module.snapshots)
    assert module.skipped_flags == [i == PLANTED for i in range(STEPS)]
    assert trainer.optimizers[0].get_skipped_steps() == 1


def assert_skipped_only_the_planted_step(snapshots):
    assert len(snapshots) == STEPS + 1
    for step in range(STEPS):
        before, after = snapshots[step], snapshots[step + 1]
        assert all(torch.isfinite(p).all() for p in after), f"step {step} left a non-finite param"
        unchanged = all(torch.equal(p, q) for p, q in zip(before, after))
        assert unchanged == (step == PLANTED), f"step {step}: unchanged={unchanged}"


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        (("32-true",), {}, "precision='32-true' is not one of"),
        (("16",), {}, "precision='16' is not one of"),
        (("bf16-mixed",), {"device": "mps"}, "device='mps' is not one of"),
        (("bf16-mixed",), {"device": "cpu", "scaler": GradScaler("cpu")}, "takes no scaler"),
        (("bf16-true",), {"device": "cpu"}, "takes no device and no scaler"),
    ],
)
@pytest.mark.parametrize("plugin", [AmpfusePrecision, AmpfuseFabricPrecision])
def test_bad_options_are_refused(plugin, args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        plugin(*args, **kwargs)


@pytest.mark.parametrize(
    "plugin, mixed, half",
    [
        (AmpfusePrecision, L.pytorch.plugins.MixedPrecision, L.pytorch.plugins.HalfPrecision),
        (AmpfuseFabricPrecision, L.fabric.plugins.MixedPrecision, L.fabric.plugins.HalfPrecision),
    ],
)
def test_plugins_are_lightnings_own_kinds(plugin, mixed, half):
    """Lightning looks for its MixedPrecision/HalfPrecision (scaler checkpoints, throughput
    monitor); the 16-mixed default scaler is ampfuse's."""
    fp16 = plugin("16-mixed", device="cpu")
    bf16 = plugin("bf16-mixed", device="cpu")
    true = plugin("bf16-true")
    for made, kind in ((fp16, mixed), (bf16, mixed), (true, half)):
        assert isinstance(made, plugin) and isinstance(made, kind), type(made).__mro__
    assert isinstance(fp16.scaler, GradScaler) and bf16.scaler is None


def test_lightning_runs_16_mixed_as_bf16_on_the_cpu_and_the_plugin_does_not():
    """What the docs say about the CPU: Lightning's own '16-mixed' turns into bf16-mixed with
    a warning; AmpfusePrecision('16-mixed', device='cpu') autocasts to fp16."""
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert trainer.precision_plugin.precision == "bf16-mixed"
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        fabric = L.Fabric(accelerator="cpu", precision="16-mixed")
    assert fabric.strategy.precision.precision == "bf16-mixed"
    for plugin in (AmpfusePrecision, AmpfuseFabricPrecision):
        with plugin("16-mixed", device="cpu").forward_context():
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.float16


def test_trainer_resume_restores_the_ampfuse_scaler_and_fused_state(tmp_path):
    """Lightning checkpoints the plugin's scaler (the plugin is a MixedPrecision) and the fused
    optimizer's state: a run resumed from a checkpoint starts from exactly the saved params,
    moments, step counts, loss scale and growth tracker."""

    class Resumed(TinyModule):
        def on_train_start(self):
            super().on_train_start()
            # state_dict() holds the live moments, which the next steps change: copy them.
            optimizer_state = copy.deepcopy(self.trainer.optimizers[0].state_dict())
            self.started_with = (optimizer_state, scaler.state_dict())

    def run(module, max_steps, ckpt_path=None):
        plugin = AmpfusePrecision("16-mixed", device="cpu", scaler=scaler)
        return fit(module, plugin, batches(STEPS // 2), max_steps, ckpt_path)

    # growth_interval=1: the scale doubles every clean step, so a scale that was not restored
    # shows.
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    first = TinyModule(lambda params: FusedAdamW(params, lr=LR))
    trainer = run(first, STEPS // 2)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    saved = (trainer.optimizers[0].state_dict(), scaler.state_dict())
    assert saved[1]["scale"] == 2.0**8 * 2 ** (STEPS // 2)

    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    resumed = Resumed(lambda params: FusedAdamW(params, lr=LR))
    run(resumed, STEPS, tmp_path / "half.ckpt")
    assert all(torch.equal(p, q) for p, q in zip(resumed.snapshots[0], first.snapshots[-1]))
    (optimizer_state, scaler_state), (saved_optimizer, saved_scaler) = resumed.started_with, saved
    assert scaler_state == saved_scaler
    assert optimizer_state["state"].keys() == saved_optimizer["state"].keys()
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved_optimizer["state"][index][key]), (index, key)
