"""O1's per-op casting, seen at the dispatcher: what really ran in which precision.

- Custom lists and ampfuse's fp32 list hold inside composite torch functions: the projections
  inside nn.MultiheadAttention and nn.TransformerEncoderLayer follow custom_black_list=["linear"],
  and the softmax inside attention runs in fp32 by default. Outside the model's forward, no list
  applies. Tensor subclasses keep their own __torch_function__.
- Custom list entries are checked: a misspelled name is an error that suggests the right one.
- apex's O1 behaviours: .cpu() of a low-precision tensor gives fp32, and an in-place op of the
  fp32 list on a low-precision tensor is refused with an error instead of running in low
  precision; a cast never redirects a call's out= tensor.

The probe is a TorchDispatchMode: it sits under the Autocast keys, where O1's casting runs, so it
records the dtype every aten op actually received.
"""

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aten_probe import AtenDtypes
from amp_models import low_dtype
from ampfuse import amp
from ampfuse.amp import casting

LINEAR_OPS = ("mm", "addmm")  # what F.linear becomes at the dispatcher, for 2-D and 3-D inputs


def o1(module, device, **options):
    return amp.initialize(module.to(device), opt_level="O1", verbosity=0, **options)


def attention_inputs(device, batch_first):
    shape = (2, 5, 16) if batch_first else (5, 2, 16)
    return torch.randn(shape, device=device)


# ---- lists hold inside composite torch functions ----------------------------------------------


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_black_list_reaches_the_projections_inside_attention(device, batch_first, need_weights):
    mha = o1(nn.MultiheadAttention(16, 2, batch_first=batch_first), device,
             custom_black_list=["linear"])
    x = attention_inputs(device, batch_first)
    with AtenDtypes() as probe:
        out, _ = mha(x, x, x, need_weights=need_weights)
    # The in-projection and the out-projection, both called inside
    # F.multi_head_attention_forward.
    linears = probe.dtypes_of(*LINEAR_OPS)
    assert len(linears) >= 2
    assert all(dtypes == {torch.float32} for dtypes in linears), linears
    out.float().sum().backward()
    assert mha.in_proj_weight.grad.dtype == torch.float32


def test_default_lists_reach_the_softmax_inside_attention(device):
    low = low_dtype(device)
    mha = o1(nn.MultiheadAttention(16, 2, batch_first=True), device)
    x = attention_inputs(device, batch_first=True)
    with AtenDtypes() as probe:
        _, weights = mha(x, x, x, need_weights=True)
    assert probe.dtypes_of("_softmax") == [{torch.float32}]
    # ...while the projections stay in the low dtype, as autocast runs them.
    assert all(dtypes == {low} for dtypes in probe.dtypes_of(*LINEAR_OPS))
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("lists, linear_dtype", [
    ({"custom_black_list": ["linear"]}, torch.float32),
    ({}, None),  # None: the low dtype
])
def test_lists_reach_inside_a_transformer_encoder_layer_in_training(device, lists, linear_dtype):
    linear_dtype = linear_dtype or low_dtype(device)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
    layer = o1(layer, device, **lists)
    layer.train()
    x = attention_inputs(device, batch_first=True)
    with AtenDtypes() as probe:
        out = layer(x)
    # Two projections inside self-attention, and the feed-forward's two linears.
    linears = probe.dtypes_of(*LINEAR_OPS)
    assert len(linears) >= 4
    assert all(dtypes == {linear_dtype} for dtypes in linears), linears
    assert all(dtypes == {torch.float32} for dtypes in probe.dtypes_of("native_layer_norm"))
    out.float().pow(2).mean().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values()), grads


def test_lists_do_not_reach_past_the_forward(device):
    low = low_dtype(device)
    mha = o1(nn.MultiheadAttention(16, 2, batch_first=True), device,
             custom_black_list=["linear"])
    x = attention_inputs(device, batch_first=True)
    mha(x, x, x)
    assert torch._C._len_torch_function_stack() == 0
    plain = nn.MultiheadAttention(16, 2, batch_first=True).to(device=device, dtype=low)
    y = x.to(low)
    with AtenDtypes() as probe:
        plain(y, y, y, need_weights=True)
    assert all(dtypes == {low} for dtypes in probe.dtypes_of(*LINEAR_OPS + ("_softmax",)))


class Tagged(torch.Tensor):
    """A tensor subclass with its own __torch_function__, which records the calls it sees."""

    seen: ClassVar[list] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", None))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensor_subclasses_keep_their_own_torch_function(device):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return F.relu(self.linear(x).as_subclass(Tagged))

    Tagged.seen.clear()
    out = o1(Model(), device)(torch.randn(2, 4, device=device))
    assert "relu" in Tagged.seen
    assert type(out) is Tagged


def test_python_tensor_methods_run_inside_the_forward(device):
    """Tensor methods written in Python that call their C implementation (unflatten, split) or
    other torch functions (norm, __repr__) give the same results as outside the forward."""
    seen = {}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            h = self.linear(x)
            seen["unflatten"] = h.unflatten(-1, (2, 2)).shape
            seen["split"] = [part.shape for part in h.split(2, dim=-1)]
            seen["norm"] = h.norm().dtype
            seen["repr"] = repr(h)
            return h

    o1(Model(), device)(torch.randn(3, 4, device=device))
    assert seen["unflatten"] == (3, 2, 2)
    assert seen["split"] == [(3, 2), (3, 2)]
    assert seen["norm"] == torch.float32
    assert seen["repr"].startswith("tensor(")


# ---- custom lists are checked -----------------------------------------------------------------


@pytest.mark.parametrize("white, black, bad, suggestion", [
    (["softmax"], ["lineer"], "lineer", "linear"),
    (["matmull"], None, "matmull", "matmul"),
    (None, ["linear", "Softmax"], "Softmax", "softmax"),
])
def test_a_misspelled_list_entry_is_an_error_that_suggests_the_name(white, black, bad, suggestion):
    with pytest.raises(ValueError, match=rf"'{bad}'.*Did you mean .*'{suggestion}'"):
        casting.check_custom_lists(white, black)


def test_list_entries_must_be_names_in_a_list_and_in_one_list_only():
    with pytest.raises(TypeError, match=r"function names.*'linear'"):
        casting.check_custom_lists(None, [F.linear])
    with pytest.raises(TypeError, match=r"custom_black_list must be a list.*\['softmax'\]"):
        casting.check_custom_lists(None, "softmax")
    with pytest.raises(ValueError, match=r"\['softmax'\] in both"):
        casting.check_custom_lists(["softmax", "matmul"], ["softmax"])
    with pytest.raises(ValueError, match=r"'no_such_op'.*never match"):
        casting.check_custom_lists(["no_such_op"], None)


def test_real_names_pass_the_check():
    casting.check_custom_lists(None, None)
    casting.check_custom_lists([], ())
    casting.check_custom_lists(
        ["matmul", "conv2d", "scaled_dot_product_attention"],
        ["linear", "softmax", "exp_", "cpu", "__matmul__", "cross_entropy", "normalize"],
    )


def test_a_python_function_with_no_aten_op_is_refused_with_the_ops_to_list():
    # O1 casts in the dispatcher, which never sees this Python function, only the aten ops
    # inside it, which the lists reach (see the attention tests above).
    with pytest.raises(ValueError, match=r"'multi_head_attention_forward' is a Python-level.*"
                                         r"'linear', 'softmax'"):
        casting.check_custom_lists(None, ["multi_head_attention_forward"])


# ---- apex's O1 behaviours on tensors ----------------------------------------------------------


class Probe(nn.Module):
    """A linear (low precision under O1) and a function of its output, run inside the forward."""

    def __init__(self, then):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.then = then
        self.result = None

    def forward(self, x):
        h = self.linear(x)
        self.result = self.then(h.detach())
        return h


def test_cpu_of_a_low_precision_tensor_is_fp32_inside_the_forward(device):
    """apex's rule for a copy to the host. On a CPU model .cpu() copies nothing and stays the
    identity: the dispatcher sees it as .to("cpu"), which CPU models call on their own tensors."""
    low = low_dtype(device)
    model = o1(Probe(lambda h: (h, h.cpu(), h.to("cpu", dtype=low))), device)
    model(torch.randn(2, 4, device=device))
    inside, copied, explicit = model.result
    assert inside.dtype == low
    assert copied.device.type == "cpu"
    if device == "cpu":
        assert copied is inside
    else:
        assert copied.dtype == torch.float32
        assert explicit.dtype == low  # a dtype asked for is kept
    assert torch.ones(2, dtype=low, device=device).cpu().dtype == low  # outside: unchanged


def _inplace(op):
    def run(h):
        if op == "**=":
            h **= 2
        elif op == "pow_":
            h.pow_(2)
        else:
            getattr(h, op)()
        return h

    return run


@pytest.mark.parametrize("op", ["exp_", "log_", "pow_", "**=", "cumsum_"])
def test_inplace_fp32_list_ops_on_low_precision_tensors_are_refused(device, op):
    run = _inplace(op) if op != "cumsum_" else (lambda h: h.cumsum_(0))
    model = o1(Probe(run), device)
    with pytest.raises(NotImplementedError, match=r"in-place .*_\(\) on a torch\.(bfloat16|float16)"
                                                  r" tensor.*fp32 list.*out-of-place"):
        model(torch.randn(2, 4, device=device))
    # fp32 tensors run them as usual, and low-precision ones outside the forward.
    run(torch.rand(2, 4, device=device))
    run(torch.rand(2, 4, device=device, dtype=low_dtype(device)))


def test_inplace_refusal_follows_the_models_lists(device):
    x = torch.randn(2, 4, device=device)
    o1(Probe(lambda h: h.add_(1)), device)(x)  # add_ is on no list: runs in place
    o1(Probe(lambda h: h.relu_()), device)(x)
    with pytest.raises(NotImplementedError, match=r"add_\(\)"):
        o1(Probe(lambda h: h.add_(1)), device, custom_black_list=["add"])(x)
    # A white-listed exp is no longer on the fp32 list.
    o1(Probe(lambda h: h.exp_()), device, custom_white_list=["exp"])(x)


def test_out_of_place_fp32_ops_and_out_arguments(device):
    low = low_dtype(device)

    def exp_both_ways(h):
        out = torch.zeros_like(h)
        torch.exp(h, out=out)
        return h.exp(), out, h

    model = o1(Probe(exp_both_ways), device)
    model(torch.randn(2, 4, device=device))
    result, out, h = model.result
    assert result.dtype == torch.float32
    # The result went into the out= tensor the caller gave, not into a cast copy of it.
    assert out.dtype == low
    assert torch.equal(out, h.float().exp().to(low))
