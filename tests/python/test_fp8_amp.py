"""amp.initialize(..., opt_level="O2", fp8=...): which layers become FP8, where the scales are
updated, what is refused, and an FP8 run on the digits set within one point of test accuracy
of the bf16 O2 run (same seed, batches and hyperparameters)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from ampfuse import amp, fp8
from ampfuse.amp import fp8_layers
from ampfuse.amp.initialize_checks import ATTR
from ampfuse.optimizers import FusedAdamW
from ampfuse.tools.demo import digits as demo
from helpers import raises_naming

STEPS = 300
BATCH = 64
TOLERANCE = 1.0  # percentage points of test accuracy (under 4 of the 360 test images)


def mlp(seed=0):
    torch.manual_seed(seed)
    # The last layer (10 outputs) is not a multiple of 16 and stays an nn.Linear.
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def setup(fp8_option, seed=0, lr=3e-3):
    """The mlp at bf16 O2; with fp8, its two 16-aligned Linears in FP8 (they are far below the
    automatic rule's size, so fp8_min_features=0 asks for them)."""
    model = mlp(seed)
    optimizer = FusedAdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    filters = {"fp8_min_features": 0} if fp8_option else {}
    return amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, fp8=fp8_option,
                          verbosity=0, **filters)


def train_step(model, optimizer, x, y):
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def one_thread():
    """Tiny matmuls: on a busy 2-core machine, waking torch's second thread cost each op
    milliseconds (60 ms per step against 1 ms on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_digits_fp8_within_one_point_of_bf16_o2(one_thread):
    x_train, y_train, x_test, y_test = demo.load_digits("cpu")
    accuracy = {}
    for name, option in (("bf16", False), ("fp8", True), ("rowwise", fp8.RowwiseScaling()),
                         ("delayed", fp8.DelayedScaling(amax_history_len=16))):
        model, optimizer = setup(option)
        gen = torch.Generator().manual_seed(1)
        order = torch.cat([torch.randperm(len(x_train), generator=gen)
                           for _ in range(STEPS * BATCH // len(x_train) + 1)])
        for step in range(STEPS):
            batch = order[step * BATCH:(step + 1) * BATCH]
            train_step(model, optimizer, x_train[batch], y_train[batch])
        with torch.no_grad():
            predicted = model(x_test).argmax(1)
        accuracy[name] = 100.0 * (predicted == y_test).float().mean().item()
    print(f"test accuracy: {accuracy}")
    assert accuracy["bf16"] >= 95.0, accuracy
    for name in ("fp8", "rowwise", "delayed"):
        assert abs(accuracy[name] - accuracy["bf16"]) <= TOLERANCE, (name, accuracy)


def test_swaps_eligible_linears_and_keeps_the_rest_of_o2():
    model, optimizer = setup(True)
    assert [type(m) for m in model if isinstance(m, torch.nn.Linear)] == [
        fp8.Linear, fp8.Linear, torch.nn.Linear]
    for layer in fp8.fp8_modules(model):
        assert layer.weight.dtype == torch.bfloat16
        assert layer.fp8_recipe == fp8.CurrentScaling()  # what fp8=True means
    assert model[5].weight.dtype == torch.bfloat16
    # Current scaling keeps no state: the checkpoint is plain O2's, weights back in fp32.
    state = model.state_dict()
    assert state["1.weight"].dtype == torch.float32
    assert not [k for k in state if "fp8" in k]
    assert not [h for h in amp_hooks(optimizer) if isinstance(h, fp8_layers.ScaleUpdates)]
    model, optimizer = setup(fp8.DelayedScaling())
    for layer in fp8.fp8_modules(model):
        assert all(b.dtype == torch.float32 for b in layer.buffers())
    assert model.state_dict()["1.fp8_grad_output_amax_history"].shape == (1024,)
    assert [h for h in amp_hooks(optimizer) if isinstance(h, fp8_layers.ScaleUpdates)]


def amp_hooks(optimizer):
    return getattr(optimizer, ATTR).hooks


def test_scales_update_once_per_step_and_not_on_a_skipped_step():
    model, optimizer = setup(fp8.DelayedScaling(amax_history_len=4))
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    train_step(model, optimizer, x, y)
    layer = model[1]
    amax = x.bfloat16().abs().max().float()  # O2 feeds the model bf16 inputs
    assert layer.fp8_input_amax_history[0].item() == amax.item()
    assert layer.fp8_input_amax_history[1].item() == 0.0
    assert layer.fp8_input_scale.item() == (torch.tensor(448.0) / amax).item()
    assert layer.fp8_input_amax.item() == 0.0
    before = copy.deepcopy(model.state_dict())
    # An overflow: amp skips the step, and the FP8 state stays (the amaxes are reset).
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
        model[3].weight.grad[0, 0] = math.inf  # before amp checks the grads at the exit
    optimizer.step()
    optimizer.zero_grad()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_refusals():
    with raises_naming("O2 option", "opt_level='O1'"):
        amp.initialize(mlp(), FusedAdamW(mlp().parameters()), opt_level="O1", fp8=True)
    with pytest.raises(TypeError, match="fp8 must be True, False or a recipe: "
                       "ampfuse.fp8.CurrentScaling, ampfuse.fp8.RowwiseScaling or "
                       "ampfuse.fp8.DelayedScaling"):
        amp.initialize(mlp(), opt_level="O2", fp8="hybrid")
    # Nothing to convert is no error (fp8=True never makes a model slower than O2): a warning.
    small = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    with pytest.warns(UserWarning, match="no Linear layer was converted"):
        amp.initialize(small, opt_level="O2", dtype=torch.bfloat16, fp8=True, verbosity=0,
                       fp8_min_features=0)


@pytest.mark.cuda
def test_cuda_refuses_gpus_below_sm89():
    if torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has FP8 GEMMs")
    with raises_naming("compute capability 8.9"):
        amp.initialize(mlp().cuda(), opt_level="O2", fp8=True)


def test_resume_through_amp_is_bit_for_bit(one_thread):
    """initialize, then load model, optimizer and amp state: the next steps give the bits of
    the run that never stopped, FP8 scales and histories included."""
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(24, 1, 8, 8, generator=gen), torch.randint(0, 10, (24,),
                                                                        generator=gen))
               for _ in range(6)]
    recipe = fp8.DelayedScaling(amax_history_len=4)
    model, optimizer = setup(recipe, seed=0)
    for x, y in batches[:3]:
        train_step(model, optimizer, x, y)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": optimizer.state_dict(),
                                "amp": amp.state_dict(optimizer)})
    for x, y in batches[3:]:
        train_step(model, optimizer, x, y)

    resumed, resumed_opt = setup(recipe, seed=5)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    amp.load_state_dict(checkpoint["amp"], resumed_opt)
    for x, y in batches[3:]:
        train_step(resumed, resumed_opt, x, y)
    state = resumed.state_dict()
    assert any(k.endswith("fp8_weight_scale") for k in state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
