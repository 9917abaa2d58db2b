"""The FP8 weight cache: quantized once per optimizer step, reused by every micro-batch, and
never stale (a weight written between forwards is seen by the next one)."""

import copy

import pytest
import torch
from ampfuse import fp8
from ampfuse.fp8 import tensorwise
from ampfuse.optimizers import FusedAdamW, FusedSGD
from helpers import make_generator


@pytest.fixture
def quantizations(monkeypatch):
    """Counts how often a weight is quantized (current scaling)."""
    calls = []
    real = tensorwise.quantize_weight_current

    def counting(weight, dtype):
        calls.append(weight)
        return real(weight, dtype)

    monkeypatch.setattr(tensorwise, "quantize_weight_current", counting)
    return calls


def model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    fp8.convert(m, min_features=0)
    return m


def batches(seed, count):
    gen = make_generator(seed)
    return [(torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen))
            for _ in range(count)]


def accumulate(m, optimizer, steps, uncached):
    for step in range(steps):
        for x, y in batches(step, 4):
            if uncached:
                fp8.invalidate(m)
            torch.nn.functional.mse_loss(m(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("opt", ["torch", "fused"])
def test_accumulation_with_the_cache_equals_the_uncached_run(opt, quantizations):
    """4 micro-batches per step, 3 steps: bit for bit the run that re-quantizes every forward,
    with one quantization per layer and step instead of four."""
    make = ((lambda p: torch.optim.AdamW(p, lr=1e-2)) if opt == "torch"
            else (lambda p: FusedAdamW(p, lr=1e-2)))
    cached, uncached = model(), model()
    accumulate(uncached, make(uncached.parameters()), 3, uncached=True)
    assert len(quantizations) == 2 * 4 * 3
    quantizations.clear()
    accumulate(cached, make(cached.parameters()), 3, uncached=False)
    assert len(quantizations) == 2 * 3
    for (name, a), b in zip(cached.state_dict().items(), uncached.state_dict().values()):
        assert torch.equal(a, b), name


def forward_sees(m, x):
    """m's output equals that of a fresh copy (nothing cached) with the same weights."""
    fresh = copy.deepcopy(m)
    fp8.invalidate(fresh)
    with torch.no_grad():
        return torch.equal(m(x), fresh(x))


WRITES = {
    "copy_": lambda m, opt: m[0].weight.copy_(m[0].weight * 2),
    "mul_": lambda m, opt: m[0].weight.mul_(0.5),
    "data =": lambda m, opt: setattr(m[0].weight, "data", m[0].weight.detach() + 1),
    "load_state_dict": lambda m, opt: m.load_state_dict(
        {k: v * 3 for k, v in copy.deepcopy(m.state_dict()).items()}),
    "FusedSGD step": lambda m, opt: opt.step(),
    "torch SGD step": lambda m, opt: torch.optim.SGD(m.parameters(), lr=1.0).step(),
    "to(float16) and back": lambda m, opt: m.half().float(),
    "invalidate after .data write": lambda m, opt: (m[0].weight.data.add_(1),
                                                    fp8.invalidate(m)),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_weight_written_from_outside_is_seen_by_the_next_forward(write):
    m = model(1)
    x = batches(9, 1)[0][0]
    opt = FusedSGD(m.parameters(), lr=1.0)
    m(x).sum().backward()  # fills the cache and gives the optimizer grads
    before = m[0].weight.detach().clone()
    with torch.no_grad():
        WRITES[write](m, opt)
    assert not torch.equal(m[0].weight, before), "the write changed nothing"
    assert forward_sees(m, x)


def test_fused_optimizer_steps_do_not_bump_the_version_but_are_seen(quantizations):
    """Why the cache listens to optimizer steps: FusedAdamW writes params in its kernel without
    bumping their version counter."""
    m = model(2)
    opt = FusedAdamW(m.parameters(), lr=1e-1)
    x = batches(3, 1)[0][0]
    m(x).sum().backward()
    version = m[0].weight._version
    opt.step()
    assert m[0].weight._version == version
    quantizations.clear()
    assert forward_sees(m, x)
    assert len(quantizations) >= 2  # m re-quantized its two layers


def test_eval_and_no_grad_use_the_cache(quantizations):
    m = model(4)
    x = batches(5, 1)[0][0]
    m(x)
    quantizations.clear()
    m.eval()
    with torch.no_grad():
        m(x)
        m(x)
    assert quantizations == []


def test_nothing_is_cached_while_compiling():
    m = model(6)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    x = batches(7, 1)[0][0]
    compiled(x).sum().backward()
    assert not m[0]._fp8_weight_cache.holds
    FusedSGD(m.parameters(), lr=1.0).step()
    eager = copy.deepcopy(m)
    fp8.invalidate(eager)
    with torch.no_grad():
        assert torch.equal(compiled(x), eager(x))


def test_amp_o2_step_is_seen():
    """Under amp O2 the optimizer steps the fp32 masters and amp writes the bf16 model params
    after the step: the next forward quantizes the new weights."""
    from ampfuse import amp

    torch.manual_seed(8)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    opt = FusedAdamW(m.parameters(), lr=1e-1)
    m, opt = amp.initialize(m, opt, opt_level="O2", dtype=torch.bfloat16, fp8=True,
                            fp8_min_features=0, verbosity=0)
    x = batches(10, 1)[0][0]
    for _ in range(2):
        before = m[0].weight.detach().clone()
        with amp.scale_loss(m(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        assert not torch.equal(m[0].weight, before)
        assert forward_sees(m, x.bfloat16())
