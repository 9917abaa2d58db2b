"""amp.initialize at O0-O3: an apex-style training script learns at every level, and each
level leaves the model in the precision it promises.

- The script is apex's, with one changed import: initialize, forward, scale_loss, backward,
  step. A CNN with BatchNorm and a one-block transformer with LayerNorm train with ampfuse's
  FusedAdam and with torch.optim.AdamW and SGD, on the CPU in bf16 and on CUDA in fp16.
- Dtypes per level: O0/O1 keep fp32 params; O2 casts conv/linear/embedding weights to the low
  dtype and keeps normalization layers (and amp's masters) fp32, and returns fp32 outputs; O3
  casts everything unless keep_batchnorm_fp32=True.
- O1 casts per op: forward hooks on modules inside the model show that linear/conv/matmul run
  in the low dtype, softmax in fp32 and the norms as torch's autocast runs them, and that
  nothing leaks out of the model's forward.
- Custom lists (custom_black_list/custom_white_list, register_*_function, the decorators) change
  the op's precision for the model they were given to, and for no other.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from amp_models import (
    OPTIMIZERS,
    SmallCNN,
    TinyTransformer,
    image_batch,
    low_dtype,
    make_model,
    make_optimizer,
    token_batch,
)
from ampfuse import amp
from ampfuse.amp.casting import NORM_TYPES
from helpers import AMPFUSE_PATH, raises_naming
from tolerances import assert_close_report

LEVELS = ("O0", "O1", "O2", "O3")
STEPS = 30
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(model_name, opt_level, optimizer_name, device, steps=STEPS, **options):
    """The apex training loop, as a user writes it."""
    model, batches = make_model(model_name, seed=0, device=device)
    extra = {}
    if optimizer_name == "AdamW" and opt_level == "O3" and low_dtype(device) == torch.float16:
        # torch.optim.AdamW computes in the params' dtype; at O3 that is fp16, where the
        # default eps=1e-8 rounds to 0 and a zero second moment divides by zero.
        extra["eps"] = 1e-4
    optimizer = make_optimizer(optimizer_name, model.parameters(), **extra)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **options)
    losses = []
    for step in range(steps):
        inputs, targets = batches(step, device=device)
        output = model(inputs)
        loss = F.cross_entropy(output, targets)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return model, optimizer, losses


def norm_and_other_params(model):
    """(params of normalization layers, all other params), by name."""
    norm, other = {}, {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            (norm if isinstance(module, NORM_TYPES) else other)[f"{module_name}.{name}"] = p
    return norm, other


def assert_dtypes(tensors, dtype, what):
    wrong = {name: t.dtype for name, t in tensors.items() if t.dtype != dtype}
    assert not wrong, f"{what} should be {dtype}, but: {wrong}"


def expected_dtypes(opt_level, low, keep_batchnorm_fp32=None):
    """(dtype of the normalization layers' params, dtype of every other param)."""
    if opt_level in ("O0", "O1"):
        return torch.float32, torch.float32
    if opt_level == "O2":
        return torch.float32, low
    return (torch.float32 if keep_batchnorm_fp32 else low), low


# ---- training at every level ------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("opt_level", LEVELS)
@pytest.mark.parametrize("model_name", ["cnn", "transformer"])
def test_loss_goes_down_and_dtypes_follow_the_level(device, model_name, opt_level, optimizer_name):
    model, optimizer, losses = train(model_name, opt_level, optimizer_name, device)
    low = low_dtype(device)

    assert all(torch.isfinite(torch.tensor(losses))), f"non-finite losses: {losses}"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, (
        f"{model_name} at {opt_level} with {optimizer_name} did not learn: mean loss of the "
        f"first 5 steps {first:.4f}, of the last 5 {last:.4f}"
    )

    norm_dtype, other_dtype = expected_dtypes(opt_level, low)
    norm, other = norm_and_other_params(model)
    assert norm and other
    assert_dtypes(norm, norm_dtype, f"{opt_level}: normalization-layer params")
    assert_dtypes(other, other_dtype, f"{opt_level}: conv/linear/embedding params")

    scale = amp.state_dict(optimizer)["loss_scaler0"]["scale"]
    if opt_level in ("O0", "O3"):
        assert scale == 1.0
    elif device == "cpu":
        # bf16 has fp32's range: O1 and O2 train it unscaled by default.
        assert scale == 1.0
        assert amp.skipped_steps(optimizer) == 0
    else:
        assert 1.0 <= scale <= 2.0**16

    masters = list(amp.master_params(optimizer))
    assert len(masters) == len(list(model.parameters()))
    if opt_level == "O2":
        assert_dtypes({str(i): m for i, m in enumerate(masters)}, torch.float32, "O2 masters")
        # The model holds its masters rounded to the low dtype, whichever optimizer stepped.
        for i, (p, m) in enumerate(zip(model.parameters(), masters)):
            assert_close_report(p, m.to(p.dtype), exact=True, msg=f"param {i} vs its master")
        # ...and the masters keep the bits the low dtype drops.
        assert any(not torch.equal(m, m.to(low).float()) for m in masters)


@pytest.mark.parametrize("opt_level", LEVELS)
def test_outputs_and_buffers(device, opt_level):
    low = low_dtype(device)
    model = SmallCNN().to(device)
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    images, _ = image_batch(0, device=device)
    output = model(images)
    # O1 hands fp32 outputs on, so a loss computed outside the forward runs in fp32 (apex's O1
    # did that by keeping loss functions on its fp32 list).
    expected_output = {"O0": torch.float32, "O1": torch.float32, "O2": torch.float32, "O3": low}
    assert output.dtype == expected_output[opt_level]
    norm_dtype, _ = expected_dtypes(opt_level, low)
    for name in ("running_mean", "running_var"):
        assert getattr(model.bn1, name).dtype == norm_dtype, name


def test_o2_outputs_fp32_and_keeps_integer_inputs(device):
    """O2 casts floating inputs to the model dtype: token ids stay integers."""
    model = TinyTransformer().to(device)
    optimizer = make_optimizer("AdamW", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    tokens, _ = token_batch(0, device=device)
    assert model.embed.weight.dtype == low_dtype(device)
    assert model(tokens).dtype == torch.float32


@pytest.mark.parametrize("model_name", ["cnn", "transformer"])
def test_o3_keep_batchnorm_fp32(device, model_name):
    low = low_dtype(device)
    model, _, losses = train(model_name, "O3", "FusedAdam", device, keep_batchnorm_fp32=True)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    norm, other = norm_and_other_params(model)
    assert_dtypes(norm, torch.float32, "O3 + keep_batchnorm_fp32: normalization params")
    assert_dtypes(other, low, "O3 + keep_batchnorm_fp32: other params")


def test_dtype_defaults_and_choice(device):
    model = SmallCNN().to(device)
    model = amp.initialize(model, opt_level="O3", verbosity=0)
    assert model.conv1.weight.dtype == low_dtype(device)
    other = torch.float16 if low_dtype(device) == torch.bfloat16 else torch.bfloat16
    if other == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    model = amp.initialize(SmallCNN().to(device), opt_level="O3", dtype=other, verbosity=0)
    assert model.conv1.weight.dtype == other


# ---- O1: per-op casting -----------------------------------------------------------------------


def record_output_dtypes(model, names):
    seen = {}

    def hook(name):
        def record(module, args, output):
            seen.setdefault(name, output.dtype)

        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    return seen, handles


def o1_transformer(device, **options):
    model = TinyTransformer().to(device)
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0, **options)
    return model, optimizer


def transformer_op_dtypes(model, device):
    seen, handles = record_output_dtypes(model, ["qkv", "scores", "attention", "norm1", "head"])
    tokens, _ = token_batch(0, device=device)
    output = model(tokens)
    for h in handles:
        h.remove()
    return seen, output


def test_o1_casts_per_op_in_the_transformer(device):
    low = low_dtype(device)
    model, optimizer = o1_transformer(device)
    seen, output = transformer_op_dtypes(model, device)
    assert seen == {
        "qkv": low,  # linear
        "scores": low,  # torch.matmul
        "attention": torch.float32,  # softmax
        # layer_norm: fp32 on CUDA (torch's autocast list); on the CPU its input is the fp32
        # residual sum, so it runs in fp32 there too.
        "norm1": torch.float32,
        "head": low,
    }
    assert output.dtype == torch.float32  # the head ran in low precision; outputs go on in fp32
    # The parameters stay fp32, and so do their grads.
    assert_dtypes(dict(model.named_parameters()), torch.float32, "O1 params")
    _, labels = token_batch(0, device=device)
    with amp.scale_loss(F.cross_entropy(output, labels), optimizer) as scaled_loss:
        scaled_loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert_dtypes(grads, torch.float32, "O1 grads")


def test_o1_casts_per_op_in_the_cnn(device):
    low = low_dtype(device)
    model = SmallCNN().to(device)
    optimizer = make_optimizer("SGD", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    seen, handles = record_output_dtypes(model, ["conv1", "bn1", "conv2", "bn2", "head"])
    images, _ = image_batch(0, device=device)
    model(images)
    for h in handles:
        h.remove()
    # batch_norm is left to the kernels, as apex's O1 and torch's autocast leave it: the conv's
    # low-precision output goes in with the fp32 weights, the statistics are fp32 inside the
    # kernel, and the output comes back in the low dtype.
    assert seen == {
        "conv1": low,
        "bn1": low,
        "conv2": low,
        "bn2": low,
        "head": low,
    }
    assert_dtypes(dict(model.named_parameters()), torch.float32, "O1 params")


def test_o1_casting_ends_with_the_forward(device):
    model, _ = o1_transformer(device)
    tokens, _ = token_batch(0, device=device)
    model(tokens)
    x = torch.randn(4, 4, device=device)
    assert torch.matmul(x, x).dtype == torch.float32
    assert torch.softmax(x.to(low_dtype(device)), dim=-1).dtype == low_dtype(device)
    assert not torch.is_autocast_enabled(torch.device(device).type)


def test_o1_custom_lists_apply_to_their_model_only(device):
    low = low_dtype(device)
    black, _ = o1_transformer(device, custom_black_list=["matmul"])
    white, _ = o1_transformer(device, custom_white_list=["softmax"])
    plain, _ = o1_transformer(device)
    o2 = TinyTransformer().to(device)
    o2 = amp.initialize(o2, opt_level="O2", verbosity=0)

    # Interleaved, each model keeps its own lists.
    for _ in range(2):
        seen_black, _ = transformer_op_dtypes(black, device)
        seen_white, _ = transformer_op_dtypes(white, device)
        seen_plain, _ = transformer_op_dtypes(plain, device)
        seen_o2, out_o2 = transformer_op_dtypes(o2, device)
        assert seen_black["scores"] == torch.float32
        assert seen_black["attention"] == torch.float32
        assert seen_white["scores"] == low
        assert seen_white["attention"] == low
        assert seen_plain["scores"] == low
        assert seen_plain["attention"] == torch.float32
        # O2 does no per-op casting: everything inside runs in the model dtype, the
        # normalization layers hand their output on in it too.
        assert seen_o2 == {k: low for k in seen_o2}
        assert out_o2.dtype == torch.float32


@pytest.mark.parametrize(
    "lists", [{"custom_black_list": ["matmul", "linear"]}, {"custom_white_list": ["softmax"]}]
)
def test_o1_trains_with_custom_lists(device, lists):
    _, _, losses = train("transformer", "O1", "FusedAdam", device, **lists)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_decorated_functions_are_cast_only_inside_an_o1_forward(device):
    low = low_dtype(device)

    @amp.float_function
    def in_fp32(x):
        return x * 2

    @amp.half_function
    def in_low(x):
        return x * 2

    @amp.promote_function
    def promoted(x, y):
        return x + y

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.seen = {}

        def forward(self, x):
            h = self.linear(x)  # low under O1
            self.seen["float"] = in_fp32(h).dtype
            self.seen["half"] = in_low(x).dtype
            self.seen["promote"] = promoted(h, x).dtype
            return h

    model = amp.initialize(Model().to(device), opt_level="O1", verbosity=0)
    model(torch.randn(2, 4, device=device))
    assert model.seen == {"float": torch.float32, "half": low, "promote": torch.float32}
    x = torch.randn(2, 4, device=device)
    assert in_low(x).dtype == torch.float32
    assert in_fp32(x.to(low)).dtype == low


_REGISTER_SCRIPT = textwrap.dedent(
    """
    import torch
    from amp_models import TinyTransformer, token_batch
    from ampfuse import amp

    def scores_dtype(model):
        seen = []
        handle = model.scores.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        model(token_batch(0)[0])
        handle.remove()
        return seen[0]

    def attention_dtype(model):
        seen = []
        handle = model.attention.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        model(token_batch(0)[0])
        handle.remove()
        return seen[0]

    before = amp.initialize(TinyTransformer(), opt_level="O1", verbosity=0)
    amp.register_float_function(torch, "matmul")
    amp.register_half_function(torch, "softmax")
    after = amp.initialize(TinyTransformer(), opt_level="O1", verbosity=0)
    o2 = amp.initialize(TinyTransformer(), opt_level="O2", verbosity=0)
    assert scores_dtype(after) == torch.float32, scores_dtype(after)
    assert attention_dtype(after) == torch.bfloat16, attention_dtype(after)
    # Registrations apply to models initialized after them only.
    assert scores_dtype(before) == torch.bfloat16, scores_dtype(before)
    assert attention_dtype(before) == torch.float32, attention_dtype(before)
    # ...and O2 does no per-op casting at all.
    assert scores_dtype(o2) == torch.bfloat16

    amp.register_promote_function(torch, "add")
    promoted = amp.initialize(torch.nn.Linear(4, 4), opt_level="O1", verbosity=0)
    out = []
    promoted.register_forward_hook(
        lambda m, a, o: out.append(torch.add(o, torch.ones(4)).dtype))
    promoted(torch.randn(2, 4))
    # The linear runs in bf16; add() of it and an fp32 tensor promotes to fp32.
    assert out == [torch.float32], out
    print("REGISTER OK")
    """
)


def test_register_functions_apply_to_models_initialized_after(tmp_path):
    """register_*_function is process-wide (as in apex), so it runs in a process of its own."""
    script = tmp_path / "register.py"
    script.write_text(_REGISTER_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [AMPFUSE_PATH, os.path.join(REPO, "tests", "python")]
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "REGISTER OK" in result.stdout


def test_register_rejects_what_it_cannot_cast():
    with raises_naming("no_such_function"):
        try:
            amp.register_float_function(torch, "no_such_function")
        except AttributeError as error:  # apex raises AttributeError here; accept either
            raise ValueError(str(error)) from error
    with raises_naming("not a torch function|decorat"):
        amp.register_half_function(os.path, "join")


# ---- what initialize returns ------------------------------------------------------------------


def test_initialize_returns_the_shapes_it_was_given():
    m1, m2 = SmallCNN(), TinyTransformer()
    o1 = make_optimizer("FusedAdam", m1.parameters())
    o2 = make_optimizer("AdamW", m2.parameters())
    models, optimizers = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    assert isinstance(models, list) and len(models) == 2
    assert isinstance(optimizers, list) and len(optimizers) == 2
    assert models[0] is m1 and models[1] is m2

    m3 = SmallCNN()
    only = amp.initialize(m3, opt_level="O1", verbosity=0)
    assert only is m3
    m4 = SmallCNN()
    both = amp.initialize(m4, make_optimizer("SGD", m4.parameters()), opt_level="O0", verbosity=0)
    assert isinstance(both, tuple) and len(both) == 2 and both[0] is m4


def test_two_models_one_optimizer_list_train_together():
    """Two models and two optimizers from one initialize; one loss spans both."""
    m1, _ = make_model("cnn", seed=1)
    m2, _ = make_model("cnn", seed=2)
    o1 = make_optimizer("FusedAdam", m1.parameters())
    o2 = make_optimizer("AdamW", m2.parameters())
    (m1, m2), (o1, o2) = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    losses = []
    for step in range(STEPS):
        images, labels = image_batch(step)
        loss = F.cross_entropy(m1(images), labels) + F.cross_entropy(m2(images), labels)
        o1.zero_grad()
        o2.zero_grad()
        with amp.scale_loss(loss, [o1, o2]) as scaled_loss:
            scaled_loss.backward()
        o1.step()
        o2.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_enabled_false_changes_nothing():
    model = SmallCNN()
    optimizer = make_optimizer("SGD", model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", enabled=False, verbosity=0)
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            assert_close_report(v, before[k], exact=True, msg=k)
    images, labels = image_batch(0)
    output = model(images)
    assert output.dtype == torch.float32
    loss = F.cross_entropy(output, labels)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert scaled_loss is loss
