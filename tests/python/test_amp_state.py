"""Checkpoints and misuse.

Resume: a run trained at O2, checkpointed ({model, optimizer, amp} with torch.save) and
continued in a NEW PROCESS ends bit for bit where the uninterrupted run ends: model params and
buffers, fp32 masters, optimizer state and loss-scaler state. The new process follows the
documented order: build model and optimizer, amp.initialize, then load the model's, the
optimizer's and amp's state.

Misuse: every bad input gives a ValueError/RuntimeError that names the problem.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from amp_models import (
    SmallCNN,
    TinyMLP,
    assert_same_snapshot,
    image_batch,
    make_model,
    make_optimizer,
    mlp_batch,
    snapshot,
    train_steps,
)
from ampfuse import amp
from helpers import AMPFUSE_PATH, raises_naming

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The steps whose loss overflows: one before the checkpoint and one after, so the loss
# scaler's state (scale 2**15 and its growth tracker) must survive the restart.
OVERFLOW_STEPS = (5, 27)
TOTAL = 40

RESUME_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch

    from amp_models import make_model, make_optimizer, train_steps
    from ampfuse import amp

    checkpoint_path, out_path, optimizer_name, threads = sys.argv[1:5]
    overflow_steps = tuple(int(s) for s in sys.argv[5].split(","))
    total = int(sys.argv[6])
    # The same thread count as the first process: CPU kernels may split work by threads.
    torch.set_num_threads(int(threads))

    # The documented order: build, initialize, then load model, optimizer and amp state.
    model, batches = make_model("cnn", seed=1234)  # other initial weights: all must be loaded
    optimizer = make_optimizer(optimizer_name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])

    train_steps(model, optimizer, amp, batches, checkpoint["step"], total, overflow_steps)
    torch.save({
        "model": model.state_dict(),
        "masters": [m.detach().clone() for m in amp.master_params(optimizer)],
        "optimizer": optimizer.state_dict(),
        "amp": amp.state_dict(),
        "skipped": amp.skipped_steps(),
    }, out_path)
    """
)


def run_python(script_path, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [AMPFUSE_PATH, os.path.join(REPO, "tests", "python")]
    )
    result = subprocess.run(
        [sys.executable, str(script_path), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"the resumed process failed:\n{result.stdout}{result.stderr}"


def final_state(model, optimizer, amp_state, masters, optimizer_state, skipped):
    """One flat dict of everything the two runs must agree on."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.items()}
    out.update({f"master[{i}]": m for i, m in enumerate(masters)})
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            out[f"optimizer.state.{index}.{key}"] = value.detach().clone()
    def flatten(prefix, value):
        if isinstance(value, dict):
            for name, v in value.items():
                flatten(f"{prefix}.{name}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                flatten(f"{prefix}[{i}]", v)
        else:
            out[prefix] = value

    for key, value in amp_state.items():
        flatten(f"amp.{key}", value)
    out["skipped"] = skipped
    return out


@pytest.mark.parametrize("checkpoint_step", [20, 0])
@pytest.mark.parametrize("optimizer_name", ["FusedAdam", "AdamW"])
def test_resume_in_a_new_process_is_bit_identical(tmp_path, optimizer_name, checkpoint_step):
    """checkpoint_step=0 saves right after amp.initialize: the fp32 masters amp made from the
    fp32 weights must be in the checkpoint even before any step ran."""
    model, batches = make_model("cnn", seed=0)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)

    train_steps(model, optimizer, amp, batches, 0, checkpoint_step, OVERFLOW_STEPS)
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "amp": amp.state_dict(optimizer),
            "step": checkpoint_step,
        },
        checkpoint,
    )
    train_steps(model, optimizer, amp, batches, checkpoint_step, TOTAL, OVERFLOW_STEPS)
    assert amp.skipped_steps(optimizer) == len(OVERFLOW_STEPS)
    expected = final_state(
        model.state_dict(),
        optimizer,
        amp.state_dict(optimizer),
        [m.detach().clone() for m in amp.master_params(optimizer)],
        optimizer.state_dict(),
        amp.skipped_steps(optimizer),
    )

    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    out = tmp_path / "resumed.pt"
    run_python(
        script,
        checkpoint,
        out,
        optimizer_name,
        torch.get_num_threads(),
        ",".join(map(str, OVERFLOW_STEPS)),
        TOTAL,
    )
    resumed = torch.load(out, weights_only=False)
    actual = final_state(
        resumed["model"],
        None,
        resumed["amp"],
        resumed["masters"],
        resumed["optimizer"],
        resumed["skipped"],
    )
    assert_same_snapshot(actual, expected, f"resumed at step {checkpoint_step} vs uninterrupted")


def test_checkpoint_holds_masters_and_scaler_state():
    """What a checkpoint carries: the loss scaler's state, and the fp32 masters either in the
    fused optimizer's state_dict or in amp's."""
    for name in ("FusedAdam", "AdamW"):
        model, batches = make_model("mlp")
        optimizer = make_optimizer(name, model.parameters())
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                          loss_scale="dynamic")  # bf16 is unscaled by default
        train_steps(model, optimizer, amp, batches, 0, 3, overflow_steps=(1,))
        state = amp.state_dict(optimizer)
        assert state["loss_scaler0"]["scale"] == 2.0**15
        assert state["loss_scaler0"]["growth_tracker"] == 1
        if name == "FusedAdam":
            saved = optimizer.state_dict()["state"]
            masters = [saved[i]["master_param"] for i in range(len(saved))]
        else:
            masters = state["master_params"][0]
        assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
        for m, live in zip(masters, amp.master_params(optimizer)):
            assert torch.equal(m, live)


def test_state_dict_with_several_initializations_alive():
    pairs = []
    for scale in (128.0, 256.0):
        model = TinyMLP()
        optimizer = make_optimizer("FusedAdam", model.parameters())
        pairs.append(
            amp.initialize(model, optimizer, opt_level="O2", loss_scale=scale, verbosity=0)
        )
    assert amp.state_dict(pairs[0][1])["loss_scaler0"]["scale"] == 128.0
    assert amp.state_dict(pairs[1][1])["loss_scaler0"]["scale"] == 256.0
    # Without an optimizer: the latest initialize, as in apex (a notebook re-run wins).
    assert amp.state_dict()["loss_scaler0"]["scale"] == 256.0
    # Loading one pair's state into the other moves only that one.
    amp.load_state_dict(amp.state_dict(pairs[0][1]), pairs[1][1])
    assert amp.state_dict(pairs[1][1])["loss_scaler0"]["scale"] == 128.0
    assert amp.state_dict(pairs[0][1])["loss_scaler0"]["scale"] == 128.0


def test_load_state_dict_rejects_a_mismatched_checkpoint():
    model = TinyMLP()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", num_losses=2, verbosity=0)
    one_loss = {"loss_scaler0": {"scale": 1024.0, "growth_tracker": 0}}
    with pytest.raises((KeyError, ValueError, RuntimeError), match="loss_scaler1|num_losses"):
        amp.load_state_dict(one_loss, optimizer)

    small = TinyMLP(hidden=4)
    small_opt = make_optimizer("AdamW", small.parameters())
    small, small_opt = amp.initialize(small, small_opt, opt_level="O2", verbosity=0)
    train_steps(small, small_opt, amp, mlp_batch, 0, 1)
    other = torch.nn.Sequential(torch.nn.Linear(8, 4))
    other_opt = make_optimizer("AdamW", other.parameters())
    other, other_opt = amp.initialize(other, other_opt, opt_level="O2", verbosity=0)
    with raises_naming("master"):
        amp.load_state_dict(amp.state_dict(small_opt), other_opt)


# ---- misuse -----------------------------------------------------------------------------------


def fresh(name="FusedAdam"):
    model = TinyMLP()
    return model, make_optimizer(name, model.parameters())


@pytest.mark.parametrize("opt_level", ["O4", "o2", "02", "", None])
def test_unknown_opt_level(opt_level):
    model, optimizer = fresh()
    with raises_naming("opt_level", "O0"):
        amp.initialize(model, optimizer, opt_level=opt_level)
    assert model.fc1.weight.dtype == torch.float32  # nothing was changed


@pytest.mark.parametrize("optimizer_name", ["FusedAdam", "AdamW"])
def test_initialize_twice_on_one_optimizer(optimizer_name):
    model, optimizer = fresh(optimizer_name)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    before = snapshot(model, optimizer, amp)
    params_before = [p for g in optimizer.param_groups for p in g["params"]]

    other = TinyMLP()
    with raises_naming("optimizer", "already"):
        amp.initialize(other, optimizer, opt_level="O2", verbosity=0)
    # Nothing was touched: the second model is still fp32 and the first pair still trains.
    assert other.fc1.weight.dtype == torch.float32
    assert [p for g in optimizer.param_groups for p in g["params"]] == params_before
    assert_same_snapshot(snapshot(model, optimizer, amp), before, "after the failed call")
    with raises_naming("model", "already"):
        amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    train_steps(model, optimizer, amp, mlp_batch, 0, 2)
    assert amp.skipped_steps(optimizer) == 0


def test_scale_loss_with_an_optimizer_never_initialized():
    model, optimizer = fresh()
    loss = F.cross_entropy(model(mlp_batch(0)[0]), mlp_batch(0)[1])
    with raises_naming("amp.initialize"), amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    for what in (amp.skipped_steps, amp.state_dict):
        with raises_naming("amp.initialize"):
            what(optimizer)


def test_optimizers_of_two_initializations_in_one_scale_loss():
    m1, o1 = fresh()
    m2, o2 = fresh()
    m1, o1 = amp.initialize(m1, o1, opt_level="O2", verbosity=0)
    m2, o2 = amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    x, y = mlp_batch(0)
    loss = F.cross_entropy(m1(x), y) + F.cross_entropy(m2(x), y)
    with raises_naming("different amp.initialize"):
        with amp.scale_loss(loss, [o1, o2]) as scaled_loss:
            scaled_loss.backward()


def test_a_model_wrapped_in_data_parallel():
    """amp.initialize comes before any data-parallel wrapper (DistributedDataParallel is covered
    in test_amp_ddp.py, which has a process group)."""
    model, optimizer = fresh()
    with raises_naming("DataParallel", "initialize"):
        amp.initialize(torch.nn.DataParallel(model), optimizer, opt_level="O2")


@pytest.mark.parametrize(
    "loss_scale", [float("inf"), float("-inf"), float("nan"), 0.0, -1.0, -128.0, "dynamc", "-8"]
)
def test_bad_static_loss_scale(loss_scale):
    model, optimizer = fresh()
    with raises_naming("loss_scale"):
        amp.initialize(model, optimizer, opt_level="O2", loss_scale=loss_scale)
    assert model.fc1.weight.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_bad_dtype(dtype):
    model, optimizer = fresh()
    with raises_naming("dtype"):
        amp.initialize(model, optimizer, opt_level="O2", dtype=dtype)


def test_bad_num_losses():
    model, optimizer = fresh()
    with raises_naming("num_losses"):
        amp.initialize(model, optimizer, opt_level="O2", num_losses=0)


def test_bad_min_max_loss_scale():
    model, optimizer = fresh()
    with raises_naming("min_scale|min_loss_scale"):
        amp.initialize(
            model, optimizer, opt_level="O2", min_loss_scale=2.0**20, max_loss_scale=2.0**10
        )


@pytest.mark.cuda
def test_bf16_on_a_gpu_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    model = TinyMLP().cuda()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    with raises_naming("bfloat16", "float16"):
        amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16)


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_a_non_finite_loss_skips_the_step(poison):
    model, optimizer = fresh("AdamW")
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    train_steps(model, optimizer, amp, mlp_batch, 0, 2)
    before = snapshot(model, optimizer, amp)
    x, y = mlp_batch(2)
    loss = F.cross_entropy(model(x), y) * poison
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert_same_snapshot(snapshot(model, optimizer, amp), before, "non-finite loss")
    assert amp.skipped_steps(optimizer) == 1


def test_cnn_checkpoint_keeps_batchnorm_fp32():
    """The BatchNorm buffers that O2 keeps fp32 are saved and loaded as fp32."""
    model = SmallCNN()
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    train_steps(model, optimizer, amp, image_batch, 0, 2)
    state = model.state_dict()
    assert state["bn1.running_mean"].dtype == torch.float32
    # Low-precision weights are saved as fp32, as apex's state-dict hook did.
    assert state["conv1.weight"].dtype == torch.float32
