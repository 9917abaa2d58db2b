"""One optimizer step, the way real training loops take it: gradient accumulation with one
scale_loss per micro-batch, several optimizers, clipping, plain steps after amp steps, and
optimizer wrappers."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_models import TinyTransformer, make_model, make_optimizer, token_batch
from ampfuse import amp
from ampfuse.optimizers import FusedAdam, FusedSGD


def _accumulate(model, optimizer, batches, steps, micro, **scale_loss_options):
    for step in range(steps):
        optimizer.zero_grad()
        for m in range(micro):
            x, y = batches(step * micro + m)
            loss = F.cross_entropy(model(x), y) / micro
            with amp.scale_loss(loss, optimizer, **scale_loss_options) as scaled:
                scaled.backward()
        optimizer.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "AdamW"])
def test_accumulation_is_exact_when_the_scale_grows_between_micro_batches(name, level):
    """growth_interval=1 makes the dynamic scale double after every clean micro-batch; the sum
    of the micro-batch gradients must not notice (the run with a static scale is the
    reference: scaling by powers of two commutes with rounding)."""
    results = []
    for options in ({"growth_interval": 1}, {"loss_scale": 2.0**16}):
        model, batches = make_model("mlp", seed=3)
        optimizer = make_optimizer(name, model.parameters())
        model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0,
                                          **options)
        _accumulate(model, optimizer, batches, steps=3, micro=4)
        results.append([p.detach().clone() for p in model.parameters()])
    for i, (dynamic, static) in enumerate(zip(*results)):
        assert torch.equal(dynamic, static), f"param {i} differs from the static-scale run"


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "AdamW"])
def test_an_overflowing_micro_batch_backs_the_scale_off_once(name):
    """An inf in the first of three micro-batches: a fused optimizer's grads keep it through
    the later checks of the step, which must not count it again (under DDP's no_sync only the
    rank that overflowed would). One backoff, one skipped step, for every optimizer kind."""
    model, batches = make_model("mlp", seed=0)
    optimizer = make_optimizer(name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                      loss_scale="dynamic")
    optimizer.zero_grad()
    for m in range(3):
        x, y = batches(m)
        loss = F.cross_entropy(model(x), y) * (float("inf") if m == 0 else 1.0)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
    optimizer.step()
    state = amp.state_dict()["loss_scaler0"]
    assert (state["scale"], amp.skipped_steps(optimizer)) == (2.0**15, 1)


def test_plain_step_after_an_amp_step_uses_its_own_grads():
    """After an overflowing amp step, a plain backward + step must step, with unscaled grads."""
    model, batches = make_model("mlp", seed=0)
    optimizer = FusedSGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    x, y = batches(0)
    optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x), y) * float("inf"), optimizer) as scaled:
        scaled.backward()
    optimizer.step()  # skipped
    assert getattr(optimizer, "grad_scale", None) is None
    assert getattr(optimizer, "found_inf", None) is None

    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    master = next(iter(amp.master_params(optimizer)))
    before = master.detach().clone()
    expected = before - 0.1 * model.fc1.weight.grad.float()
    optimizer.step()
    torch.testing.assert_close(master, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
@pytest.mark.parametrize("micro", [2, 3])
def test_o2_torch_optim_accumulation_unscales_fp32_params_once(name, micro):
    """LayerNorm params stay fp32 at O2 and have no master: their grads of earlier
    micro-batches must not be divided by the scale again by the next scale_loss."""
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = make_optimizer(name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=128.0,
                                      verbosity=0)
    singles = []
    for m in range(micro):
        optimizer.zero_grad()
        x, y = token_batch(m)
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
        singles.append(model.norm1.weight.grad.clone())
    optimizer.zero_grad()
    for m in range(micro):
        x, y = token_batch(m)
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
    torch.testing.assert_close(model.norm1.weight.grad, sum(singles), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("names", [("SGD", "SGD"), ("FusedAdam", "AdamW"),
                                   ("AdamW", "FusedAdam"), ("FusedAdam", "FusedSGD")])
def test_an_overflow_in_either_optimizer_skips_both(names):
    model, batches = make_model("mlp", seed=0)
    first = make_optimizer(names[0], model.fc1.parameters())
    second = make_optimizer(names[1], model.fc2.parameters())
    model, (first, second) = amp.initialize(model, [first, second], opt_level="O1",
                                            verbosity=0)
    x, y = batches(0)
    before = [p.detach().clone() for p in model.parameters()]
    for poisoned in (model.fc1.bias, model.fc2.bias):
        with amp.scale_loss(F.cross_entropy(model(x), y), [first, second]) as scaled:
            scaled.backward()
            poisoned.grad[0] = float("nan")
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        for i, (p, b) in enumerate(zip(model.parameters(), before)):
            assert torch.equal(p, b), f"param {i} stepped although the other optimizer overflowed"


def test_master_params_have_grads_for_clipping_with_several_losses():
    model, batches = make_model("mlp", seed=0)
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", num_losses=2,
                                      verbosity=0)
    x, y = batches(0)
    out = model(x)
    with amp.scale_loss(F.cross_entropy(out, y), optimizer, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with amp.scale_loss(out.float().pow(2).mean(), optimizer, loss_id=1) as scaled:
        scaled.backward()
    masters = list(amp.master_params(optimizer))
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in masters)
    norm = torch.nn.utils.clip_grad_norm_(masters, max_norm=1e-3)
    assert norm > 1e-3
    clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in masters]))
    torch.testing.assert_close(clipped, torch.tensor(1e-3), rtol=1e-3, atol=0)
    before = [m.detach().clone() for m in masters]
    optimizer.step()
    assert any(not torch.equal(m, b) for m, b in zip(amp.master_params(optimizer), before))


class _TrustRatioWrapper:
    """An optimizer wrapper in the style of LARC: not a torch.optim.Optimizer, it rescales
    every grad by a per-param trust ratio and steps the optimizer it holds."""

    def __init__(self, optimizer, trust=0.02):
        self.optim = optimizer
        self.trust = trust

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state):
        self.optim.load_state_dict(state)

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = self.trust * p.norm() / (p.grad.norm() + 1e-12)
                    p.grad.mul_(torch.clamp(ratio, max=1.0))
        self.optim.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_optimizer_wrappers_like_larc_are_accepted(level):
    model, batches = make_model("mlp", seed=0)
    optimizer = _TrustRatioWrapper(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    assert isinstance(optimizer, _TrustRatioWrapper)
    losses = []
    for step in range(30):
        x, y = batches(step)
        loss = F.cross_entropy(model(x), y)
        if step == 3:
            loss = loss * float("inf")
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())
    assert amp.skipped_steps(optimizer) == 1
    assert sum(losses[-5:]) < sum(losses[:3]) * 5 / 3


def test_sparse_grads_under_o1_are_unscaled():
    emb = nn.Embedding(50, 8, sparse=True)
    head = nn.Linear(8, 4)
    model = nn.Sequential(emb, head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    tokens = torch.randint(0, 50, (16,))
    target = torch.randint(0, 4, (16,))
    with amp.scale_loss(F.cross_entropy(model(tokens), target), optimizer) as scaled:
        scaled.backward()
    scaled_grad = emb.weight.grad.coalesce().values().clone()
    reference = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 4))
    reference.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = reference(tokens)
    F.cross_entropy(out.float(), target).backward()
    torch.testing.assert_close(scaled_grad, reference[0].weight.grad.coalesce().values())


def test_the_o2_fused_path_reads_nothing_from_the_device(monkeypatch):
    """The overflow summary (verbosity=1) must not read the device at any step count; on CPU
    the proxy is: no Tensor.item()/tolist()/bool()/float() on the training path."""
    model, batches = make_model("mlp", seed=0)
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=1)

    def forbidden(*args, **kwargs):
        raise AssertionError("a host read on the O2 fused training path")

    records = []
    handler = _ListHandler(records)
    logging.getLogger("ampfuse.amp").addHandler(handler)
    try:
        batch = [batches(s) for s in range(4)]
        for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        for step in range(250):
            x, y = batch[step % 4]
            loss = F.cross_entropy(model(x), y)
            if step in (10, 150):
                loss = loss * float("inf")
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        monkeypatch.undo()
    finally:
        logging.getLogger("ampfuse.amp").removeHandler(handler)
    assert amp.skipped_steps(optimizer) == 2
    assert any("skipped for gradient overflow" in r for r in records), records


class _ListHandler(logging.Handler):
    def __init__(self, records):
        super().__init__()
        self.records = records

    def emit(self, record):
        self.records.append(record.getMessage())


def test_initialized_optimizers_carry_apex_amp_stash():
    model, _ = make_model("mlp")
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert hasattr(optimizer, "_amp_stash")
    assert optimizer._amp_stash.all_fp32_from_fp16_params[0].dtype == torch.float32


@pytest.mark.cuda
def test_the_o2_fused_path_never_syncs_on_cuda():
    """Over 250 O2 steps with overflows and the verbosity=1 summary, CUDA's sync debug mode
    raises on any host sync."""
    model, batches = make_model("mlp", seed=0, device="cuda")
    optimizer = make_optimizer("FusedAdam", model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=1)
    batch = [batches(s, device="cuda") for s in range(4)]
    poison = torch.tensor(float("inf"), device="cuda")
    one = torch.tensor(1.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(250):
            x, y = batch[step % 4]
            loss = F.cross_entropy(model(x), y) * (poison if step in (10, 150) else one)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert amp.skipped_steps(optimizer) == 2
