"""O1's casting in the dispatcher (csrc/autocast/, amp/per_op.py, amp/aten_lists.py).

- Every entry of ampfuse's fp32 list gives an fp32 result inside an O1 forward; custom lists
  move entries; ops on no list do exactly what torch.autocast does.
- Scoping: nothing is cast outside the model's forward, a user's own torch.autocast keeps
  torch's behaviour for the ops ampfuse re-registered, and another thread is not affected.
- Policy sets: two models with different lists in one process, nested calls, and every
  registration released when the models are garbage collected.
- No Python runs per op inside the forward: only the two forward hooks.
"""

import copy
import gc
import io
import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
import ampfuse
from ampfuse import amp
from ampfuse.amp import aten_lists, per_op
from torch import nn


def registered_ops():
    return set(torch.ops.ampfuse.o1_registered_ops())


class Runner(nn.Module):
    """Runs `fn` on its inputs inside the forward and keeps the result (the forward's own
    output is cast to fp32 by O1's output hook, so the result is read from here)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.fn = None
        self.result = None

    def forward(self, *inputs):
        self.result = self.fn(*inputs)
        return self.linear(inputs[0].float())


def o1(module, device="cpu", **options):
    return amp.initialize(module.to(device), opt_level="O1", verbosity=0, **options)


def inputs(device, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(4, 8, generator=gen).add_(0.1).to(device=device, dtype=dtype)
    y = torch.rand(4, 8, generator=gen).add_(0.1).to(device=device, dtype=dtype)
    target = torch.tensor([0, 3, 5, 7], device=device)
    return x, y, target


# One call per entry of ampfuse's fp32 list ("cpu" is tested on its own below).
FP32_SAMPLES = {
    "softmax": lambda x, y, t: x.softmax(-1),
    "log_softmax": lambda x, y, t: F.log_softmax(x, -1),
    "softmin": lambda x, y, t: F.softmin(x, -1),
    "rms_norm": lambda x, y, t: F.rms_norm(x, (8,)),
    "normalize": lambda x, y, t: F.normalize(x, dim=-1),
    "norm": lambda x, y, t: x.norm(),
    "exp": lambda x, y, t: torch.exp(x),
    "expm1": lambda x, y, t: x.expm1(),
    "log": lambda x, y, t: torch.log(x),
    "log1p": lambda x, y, t: x.log1p(),
    "log2": lambda x, y, t: x.log2(),
    "log10": lambda x, y, t: x.log10(),
    "pow": lambda x, y, t: torch.pow(x, 2),
    "__pow__": lambda x, y, t: x ** y,
    "__rpow__": lambda x, y, t: 2 ** x,
    "sum": lambda x, y, t: x.sum(),
    "mean": lambda x, y, t: x.mean(-1),
    "prod": lambda x, y, t: x.prod(),
    "cumsum": lambda x, y, t: x.cumsum(0),
    "cumprod": lambda x, y, t: torch.cumprod(x, 1),
    "logsumexp": lambda x, y, t: torch.logsumexp(x, -1),
    "var": lambda x, y, t: x.var(),
    "std": lambda x, y, t: torch.std(x, 0),
    "softplus": lambda x, y, t: F.softplus(x),
    "cross_entropy": lambda x, y, t: F.cross_entropy(x, t),
    "nll_loss": lambda x, y, t: F.nll_loss(x, t),
    "mse_loss": lambda x, y, t: F.mse_loss(x, y),
    "l1_loss": lambda x, y, t: F.l1_loss(x, y),
    "smooth_l1_loss": lambda x, y, t: F.smooth_l1_loss(x, y),
    "huber_loss": lambda x, y, t: F.huber_loss(x, y),
    "kl_div": lambda x, y, t: F.kl_div(x, y, reduction="batchmean"),
    "binary_cross_entropy": lambda x, y, t: F.binary_cross_entropy(x.sigmoid(), y.sigmoid()),
    "binary_cross_entropy_with_logits":
        lambda x, y, t: F.binary_cross_entropy_with_logits(x, y.sigmoid()),
    "poisson_nll_loss": lambda x, y, t: F.poisson_nll_loss(x, y),
    "cosine_similarity": lambda x, y, t: F.cosine_similarity(x, y),
}

# Norms on no ampfuse list (aten_lists.NORMS_LEFT_TO_AUTOCAST): torch's autocast decides.
NORM_SAMPLES = {
    "layer_norm": lambda x, y, t: F.layer_norm(x, (8,), torch.ones(8) * 1.5, torch.ones(8) / 3),
    "group_norm": lambda x, y, t: F.group_norm(x, 2, torch.ones(8) * 1.5, torch.ones(8) / 3),
    "batch_norm": lambda x, y, t: F.batch_norm(x, torch.zeros(8), torch.ones(8),
                                               torch.ones(8) * 1.5, torch.ones(8) / 3,
                                               training=True),
    "instance_norm": lambda x, y, t: F.instance_norm(x.view(1, 4, 8), weight=torch.ones(4) * 1.5,
                                                     bias=torch.ones(4) / 3),
}

# Ops on no ampfuse list: O1 gives them what torch.autocast gives them.
TORCH_SAMPLES = {
    "linear": lambda x, y, t, w: F.linear(x, w),
    "matmul": lambda x, y, t, w: x @ w,
    "bmm": lambda x, y, t, w: torch.bmm(x.unsqueeze(0), w.unsqueeze(0)),
    "gelu": lambda x, y, t, w: F.gelu(x),
    "add": lambda x, y, t, w: x + w[:4],
    "relu": lambda x, y, t, w: torch.relu(x),
    "sdpa": lambda x, y, t, w: F.scaled_dot_product_attention(x[None], y[None], w[None, :4]),
}


def test_every_fp32_list_entry_has_a_sample():
    assert set(FP32_SAMPLES) | {"cpu"} == aten_lists.FP32_FUNCTIONS
    assert set(NORM_SAMPLES) == aten_lists.NORMS_LEFT_TO_AUTOCAST
    assert not aten_lists.NORMS_LEFT_TO_AUTOCAST & aten_lists.FP32_FUNCTIONS


class TestListedOps:
    """One pair of O1 models for the whole class, dropped after it (the tests further down
    need the registry empty)."""

    @pytest.fixture(scope="class")
    @classmethod
    def runners(cls):
        cpu = o1(Runner())
        white = o1(Runner(), custom_white_list=["softmax", "layer_norm", "sum", "exp"])
        yield cpu, white
        del cpu, white
        gc.collect()

    @pytest.mark.parametrize("name", sorted(FP32_SAMPLES))
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_fp32_list_entries_give_fp32_inside_the_forward(self, runners, name, dtype):
        runner = runners[0]
        runner.fn = FP32_SAMPLES[name]
        runner(*inputs("cpu", dtype))
        assert runner.result.dtype == torch.float32, name

    @pytest.mark.parametrize("name", ["softmax", "layer_norm", "sum", "exp"])
    def test_white_listed_entries_run_in_the_low_dtype(self, runners, name):
        runner = runners[1]
        runner.fn = {**FP32_SAMPLES, **NORM_SAMPLES}[name]
        runner(*inputs("cpu", torch.float32))  # fp32 inputs: the white list casts them down
        assert runner.result.dtype == torch.bfloat16, name

    @pytest.mark.parametrize("name", sorted(NORM_SAMPLES))
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_norms_run_as_cpu_autocast_runs_them(self, runners, name, dtype):
        """On the CPU a low-precision input stays low: torch's kernel computes the statistics
        in fp32 and rounds the output, so O1 gives CPU autocast's result to the bit and adds no
        casts (with the norm on the fp32 list it gave fp32)."""
        runner = runners[0]
        runner.fn = NORM_SAMPLES[name]
        x, y, t = inputs("cpu", dtype)
        runner(x, y, t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = NORM_SAMPLES[name](x, y, t)
        assert runner.result.dtype == dtype, name
        assert torch.equal(runner.result, expected), name

    @pytest.mark.parametrize("name", sorted(NORM_SAMPLES))
    def test_black_listed_norms_run_in_fp32_on_the_cpu(self, name):
        model = o1(Runner(), custom_black_list=[name])
        model.fn = NORM_SAMPLES[name]
        x, y, t = inputs("cpu", torch.bfloat16)
        model(x, y, t)
        assert model.result.dtype == torch.float32, name
        torch.testing.assert_close(model.result, NORM_SAMPLES[name](x.float(), y, t))
        del model
        gc.collect()

    @pytest.mark.parametrize("name", sorted(TORCH_SAMPLES))
    def test_ops_on_no_list_do_what_torch_autocast_does(self, runners, name):
        runner = runners[0]
        x, y, t = inputs("cpu", torch.float32)
        w = torch.randn(8, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = TORCH_SAMPLES[name](x, y, t, w).dtype
        runner.fn = lambda x, y, t: TORCH_SAMPLES[name](x, y, t, w)
        runner(x, y, t)
        assert runner.result.dtype == expected, name


# ---- scoping ----------------------------------------------------------------------------------

# Ops that ampfuse re-registers and torch's CPU autocast also has a kernel for (linear, prod,
# mse_loss), or has none for (softmax, layer_norm, exp), or that are not floating (cumsum of
# ints): outside an O1 forward each must do what torch alone does.
SCOPING_CALLS = {
    "linear": lambda x, w: F.linear(x, w),
    "prod": lambda x, w: x.prod(),
    "mse_loss": lambda x, w: F.mse_loss(x, w[:4]),
    "softmax": lambda x, w: x.softmax(-1),
    "layer_norm": lambda x, w: F.layer_norm(x, (8,)),
    "exp": lambda x, w: x.exp(),
    "int cumsum": lambda x, w: torch.arange(4).cumsum(0),
}


def _autocast_dtypes(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return {name: call(x, w).dtype for name, call in SCOPING_CALLS.items()}


def test_a_users_own_autocast_outside_the_model_keeps_torchs_behaviour():
    gc.collect()
    assert registered_ops() == set(), "another test left an O1 model alive"
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    torch_alone = _autocast_dtypes(x, w)
    model = o1(Runner(), custom_black_list=["linear"], custom_white_list=["prod"])
    assert {"aten::linear", "aten::prod", "aten::softmax.int"} <= registered_ops()
    assert _autocast_dtypes(x, w) == torch_alone
    # ...while inside the forward the model's lists apply.
    model.fn = lambda x: {name: call(x, w).dtype for name, call in SCOPING_CALLS.items()}
    model(x)
    assert model.result["linear"] == torch.float32
    assert model.result["prod"] == torch.bfloat16
    assert model.result["softmax"] == torch.float32
    assert model.result["int cumsum"] == torch.int64
    # And with no autocast at all, nothing is cast.
    assert F.linear(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    assert torch.matmul(x, w).dtype == torch.float32


def test_another_thread_is_not_affected_by_a_running_forward():
    seen = {}

    def other_thread():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen["other"] = torch.randn(4, 8).bfloat16().softmax(-1).dtype

    def forward(x, y, t):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        return x.softmax(-1)

    model = o1(Runner())
    model.fn = forward
    model(*inputs("cpu", torch.bfloat16))
    assert model.result.dtype == torch.float32
    assert seen["other"] == torch.bfloat16  # CPU autocast leaves softmax alone


# ---- policy sets ------------------------------------------------------------------------------


def test_two_models_with_different_lists_and_nested_calls():
    black = o1(Runner(), custom_black_list=["linear"])
    white = o1(Runner(), custom_white_list=["softmax"])
    w = torch.randn(8, 8)

    def probe(x, y, t):
        return F.linear(x, w).dtype, x.softmax(-1).dtype

    black.fn = white.fn = probe
    x = inputs("cpu", torch.float32)
    for _ in range(2):  # interleaved calls
        black(*x)
        assert black.result == (torch.float32, torch.float32)
        white(*x)
        assert white.result == (torch.bfloat16, torch.bfloat16)

    def nested(x, y, t):
        inner = white(x, y, t)  # white's lists inside, black's again after it returns
        return white.result, probe(x, y, t), inner

    black.fn = nested
    black(*x)
    inner_result, after, _ = black.result
    assert inner_result == (torch.bfloat16, torch.bfloat16)
    assert after == (torch.float32, torch.float32)


def test_registrations_are_released_when_the_models_are_collected():
    gc.collect()
    assert registered_ops() == set(), "another test left an O1 model alive"
    has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert not has_cpu_kernel("aten::softmax.int", "AutocastCPU")  # torch has none on CPU

    first = o1(Runner(), custom_black_list=["linear"])
    second, optimizer = amp.initialize(Runner(), torch.optim.SGD(Runner().parameters(), 0.1),
                                       opt_level="O1", verbosity=0)
    both = registered_ops()
    assert "aten::linear" in both and "aten::softmax.int" in both
    assert has_cpu_kernel("aten::softmax.int", "AutocastCPU")

    del first
    gc.collect()
    assert registered_ops() == both - {"aten::linear"}  # only `first` listed linear
    assert "registry.cpp" not in torch._C._dispatch_dump("aten::linear")  # torch's is back
    del second, optimizer
    gc.collect()
    assert registered_ops() == set()
    assert not has_cpu_kernel("aten::softmax.int", "AutocastCPU")


def test_a_copy_of_the_model_keeps_its_lists_after_the_original_is_gone():
    """EMA helpers deepcopy the model and checkpoints pickle it: each copy registers its own
    set, so it keeps casting when the original is collected, and releases it when it goes."""
    model = o1(Runner(), custom_black_list=["linear"])
    ema = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    del model
    gc.collect()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    w = torch.randn(8, 8)
    for copied in (ema, loaded):
        copied.fn = lambda x, y, t: F.linear(x, w).dtype
        copied(*inputs("cpu", torch.float32))
        assert copied.result == torch.float32
    del ema, loaded, copied
    gc.collect()
    assert registered_ops() == set()


def test_a_failing_pre_hook_before_amps_leaves_the_outer_forward_alone():
    """torch runs always_call forward hooks even when an earlier pre-hook raised, so amp's
    post-hook runs without its pre-hook: it must not end the enclosing O1 forward's casting."""
    inner = Runner()
    inner.register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(
        RuntimeError("user pre-hook failed")))
    inner = o1(inner)
    outer = o1(Runner())

    def forward(x, y, t):
        with pytest.raises(RuntimeError, match="user pre-hook failed"):
            inner(x, y, t)
        return x.softmax(-1).dtype, torch.is_autocast_enabled("cpu")

    outer.fn = forward
    outer(*inputs("cpu", torch.bfloat16))
    assert outer.result == (torch.float32, True)
    assert per_op._active_stack() == []
    assert not torch.is_autocast_enabled("cpu")
    assert torch.ops.ampfuse.o1_exchange_active_set(0) == 0


def test_policy_set_errors_name_the_problem():
    create = torch.ops.ampfuse.o1_policy_set_create
    with pytest.raises(ValueError, match=r"unknown cast policy 'half'.*fp32, lower"):
        create(["aten::exp"], ["half"])
    with pytest.raises(ValueError, match=r"no aten operator aten::no_such_op"):
        create(["aten::no_such_op"], ["fp32"])
    with pytest.raises(ValueError, match=r"1 ops but 2 policies"):
        create(["aten::exp"], ["fp32", "fp32"])
    with pytest.raises(ValueError, match=r"aten::exp is listed twice"):
        create(["aten::exp", "aten::exp"], ["fp32", "fp32"])
    gc.collect()
    assert registered_ops() == set()  # nothing half-registered
    set_id = create(["aten::exp"], ["fp32"])
    torch.ops.ampfuse.o1_policy_set_release(set_id)
    with pytest.raises(ValueError, match=rf"no policy set {set_id} \(already released\?\)"):
        torch.ops.ampfuse.o1_policy_set_release(set_id)


# ---- no Python per op -------------------------------------------------------------------------


# ampfuse's own sources (a venv's path may contain "ampfuse" too, e.g. ~/.cache/ampfuse/venv).
AMPFUSE_DIR = os.path.dirname(os.path.abspath(ampfuse.__file__)) + os.sep


def test_no_python_runs_per_op_inside_the_forward():
    """Inside the forward only the model's own Python runs: no TorchFunctionMode, no amp code
    per op. amp's Python is the two forward hooks and the output cast, whatever the op count."""

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            assert torch._C._len_torch_function_stack() == 0
            for layer in self.layers:
                x = self.norm(F.gelu(layer(x))).softmax(-1).log()
            return x.sum()

    model = o1(Deep())
    x = torch.randn(4, 8)
    model(x)
    amp_calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(AMPFUSE_DIR):
            amp_calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        model(x)
    finally:
        sys.setprofile(None)
    # The pre-hook, the post-hook and the fp32 output cast, each with its few helpers.
    assert len(amp_calls) < 12, amp_calls


# ---- CUDA --------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_fp32_list_and_host_copies():
    model = o1(Runner(), "cuda")
    model.fn = lambda x, y, t: (x.softmax(-1).dtype, F.linear(x, y).dtype, x.cpu().dtype,
                                x.to("cpu", dtype=torch.float16).dtype,
                                F.layer_norm(x, (8,)).dtype, F.group_norm(x, 2).dtype)
    model(*inputs("cuda", torch.float16))
    # The norms are fp32 by torch's CUDA autocast list (ampfuse leaves them to it).
    assert model.result == (torch.float32, torch.float16, torch.float32, torch.float16,
                            torch.float32, torch.float32)
    with torch.autocast("cuda", dtype=torch.float16):
        x = torch.randn(4, 8, device="cuda", dtype=torch.float16)
        assert x.cpu().dtype == torch.float16  # outside the model: torch's behaviour
        assert x.softmax(-1).dtype == torch.float32  # torch's CUDA autocast keeps it fp32


# ---- torch.compile -----------------------------------------------------------------------------


def test_a_compiled_o1_model_applies_the_lists_like_eager():
    """The hooks run eagerly around the compiled forward, which is traced with the model's
    policy set active: black-listed linears stay fp32, so the result is eager O1's to the bit
    and not what plain autocast (bf16 linears) gives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16))
    plain = nn.Sequential(*(m for m in model))  # the same modules, without amp's hooks
    model = o1(model, custom_black_list=["linear"])
    x = torch.randn(4, 16)
    eager = model(x)
    compiled = torch.compile(model)(x)
    assert torch.equal(compiled, eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(plain(x).float(), eager)
    compiled.sum().backward()
    assert model[0].weight.grad.dtype == torch.float32
