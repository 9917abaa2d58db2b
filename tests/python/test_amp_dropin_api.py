"""apex's spellings and private handles that real scripts use, and the refusals that replace
silent wrong answers."""

import pytest
import torch
import torch.nn.functional as F

from amp_models import make_model, make_optimizer, train_steps
from ampfuse import amp
from helpers import raises_naming


def test_float64_model_is_refused_at_o2_and_o1_with_the_fix():
    for level in ("O1", "O2", "O3"):
        model, _ = make_model("mlp")
        model = model.double()
        optimizer = make_optimizer("AdamW", model.parameters())
        with raises_naming("float64", "model.float()"):
            amp.initialize(model, optimizer, opt_level=level)
        assert model.fc1.weight.dtype == torch.float64, "a refused initialize changed the model"


def test_float64_model_at_o0_becomes_fp32_as_in_apex():
    model, _ = make_model("mlp")
    model = amp.initialize(model.double(), opt_level="O0", verbosity=0)
    assert model.fc1.weight.dtype == torch.float32


@pytest.mark.parametrize("given, scale, dynamic", [
    ("128.0", 128.0, False), ("dynamic", 2.0**16, True), (512, 512.0, False)])
def test_loss_scale_spellings(given, scale, dynamic):
    model, _ = make_model("mlp")
    optimizer = make_optimizer("AdamW", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=given,
                                      verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.loss_scale() == scale and scaler._loss_scale == scale
    assert scaler.dynamic is dynamic
    assert amp._amp_state.opt_properties.opt_level == "O2"


def test_a_loss_scale_string_that_is_no_number_is_an_error():
    model, _ = make_model("mlp")
    with raises_naming("loss_scale", "'dynamc'"):
        amp.initialize(model, make_optimizer("AdamW", model.parameters()), opt_level="O2",
                       loss_scale="dynamc")


def test_setting_apex_private_loss_scale_changes_the_scale_used():
    model, batches = make_model("mlp")
    optimizer = make_optimizer("SGD", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 1024.0
    x, y = batches(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        assert scaled.item() == pytest.approx(F.cross_entropy(model(x), y).item() * 1024.0)
        scaled.backward()


def test_disable_casts_runs_fp32_inside_an_o1_forward():
    seen = {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            seen["cast"] = h.dtype
            with amp.disable_casts():
                h = self.b(h.float())
            seen["disabled"] = h.dtype
            return h

    model = Model()
    model, _ = amp.initialize(model, make_optimizer("SGD", model.parameters()), opt_level="O1",
                              verbosity=0)
    model(torch.randn(2, 4))
    assert seen == {"cast": torch.bfloat16, "disabled": torch.float32}


def test_optimizer_amp_stash_exists_like_apex():
    model, _ = make_model("mlp")
    optimizer = make_optimizer("AdamW", model.parameters())
    assert not hasattr(optimizer, "_amp_stash")
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    stash = optimizer._amp_stash
    assert [p.dtype for p in stash.all_fp16_params] == [torch.bfloat16] * 4
    assert [p.dtype for p in stash.all_fp32_from_fp16_params] == [torch.float32] * 4


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_custom_lists_at_a_level_that_ignores_them_are_an_error(level):
    model, _ = make_model("mlp")
    with raises_naming("custom_white_list", "O1"):
        amp.initialize(model, make_optimizer("AdamW", model.parameters()), opt_level=level,
                       custom_white_list=["matmul"])


def test_cast_model_type_false_means_leave_the_model_alone():
    model, batches = make_model("mlp")
    optimizer = make_optimizer("AdamW", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", cast_model_type=False,
                                      verbosity=0)
    assert model.fc1.weight.dtype == torch.float32
    train_steps(model, optimizer, amp, batches, 0, 2)


def test_o1_loss_outside_the_forward_is_fp32():
    model, batches = make_model("mlp")
    optimizer = make_optimizer("AdamW", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    x, y = batches(0)
    output = model(x)
    loss = F.cross_entropy(output, y)
    assert output.dtype == torch.float32 and loss.dtype == torch.float32
    # The head still ran in low precision: its output is bf16-representable.
    assert torch.equal(output, output.to(torch.bfloat16).float())


def test_a_misspelled_custom_list_entry_is_an_error_at_initialize():
    model, _ = make_model("mlp")
    with raises_naming("lineer", "linear"):
        amp.initialize(model, make_optimizer("AdamW", model.parameters()), opt_level="O1",
                       custom_black_list=["lineer"])


def test_disable_casts_also_stops_decorated_functions():
    @amp.half_function
    def project(x, w):
        return x @ w

    seen = {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            seen["cast"] = project(x, self.w).dtype
            with amp.disable_casts():
                seen["disabled"] = project(x, self.w).dtype
            return project(x, self.w).float().sum()

    model = Model()
    model, _ = amp.initialize(model, make_optimizer("SGD", model.parameters()), opt_level="O1",
                              verbosity=0)
    model(torch.randn(2, 4))
    assert seen == {"cast": torch.bfloat16, "disabled": torch.float32}


def test_user_registered_norm_type_stays_fp32_at_o2():
    class MyNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.gain.to(x.dtype) / x.float().pow(2).mean(-1, keepdim=True).sqrt()

    handle = amp.register_norm_type(MyNorm)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), MyNorm())
        model, _ = amp.initialize(model, make_optimizer("AdamW", model.parameters()),
                                  opt_level="O2", verbosity=0)
        assert model[1].gain.dtype == torch.float32
        assert model[0].weight.dtype == torch.bfloat16
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["FusedAdam", "AdamW"])
def test_o2_with_cast_model_type_false_scales_the_loss_and_keeps_the_model_dtype(name):
    """apex's O2 with cast_model_type=False casts nothing (no weights, inputs or outputs) and
    keeps fp32 masters for the params the user already made low precision."""
    model, batches = make_model("mlp")
    model.to(torch.bfloat16)  # the user's own choice
    optimizer = make_optimizer(name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", cast_model_type=False,
                                      loss_scale="dynamic", verbosity=0)
    assert model.fc1.weight.dtype == torch.bfloat16
    for step in range(3):
        x, y = batches(step)
        with pytest.raises(RuntimeError, match="same dtype"):
            model(x)  # no input cast
        out = model(x.to(torch.bfloat16))
        assert out.dtype == torch.bfloat16  # no output cast
        optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(out.float(), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    masters = {tuple(m.shape): m for m in amp.master_params(optimizer)}
    fc1_master = masters[tuple(model.fc1.weight.shape)]
    assert fc1_master.dtype == torch.float32 and fc1_master is not model.fc1.weight
    assert torch.equal(fc1_master.to(torch.bfloat16), model.fc1.weight)
    assert not torch.equal(fc1_master, fc1_master.to(torch.bfloat16).float())  # fp32 bits kept
    assert amp.state_dict()["loss_scaler0"]["scale"] == 2.0**16  # dynamic scaling
