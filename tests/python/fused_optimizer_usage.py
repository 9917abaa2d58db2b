"""Checks that every fused optimizer of apex's family (FusedLAMB, FusedNovoGrad, FusedAdagrad)
must pass in the same way: loss scales divided out bit for bit, a torch GradScaler driving it,
skip_nonfinite leaving everything as it was, torch.compile giving the eager bits, amp O1/O2
training like fp32, DTensor params stepping like plain ones, and bad options refused by name.
Each takes `make`, a function from a list of params (and options) to the optimizer."""

from __future__ import annotations

import torch

import ampfuse
from ampfuse.optimizers._precision import EXTRA_KEYS, param_mode, precise_value, split_halves
from helpers import raises_naming
from tolerances import assert_close_report
from test_adam import clone_params, make_params, set_grads, step_grads


def check_scaled_grads_give_the_unscaled_result(make, shapes, dtype, device):
    """A power-of-two loss scale divides out exactly: every grad (written back unscaled) and
    every norm the optimizer takes of them."""
    params = make_params(shapes, dtype, device)
    scaled = clone_params(params)
    opt, opt_scaled = make(params, master_weights=True), make(scaled, master_weights=True)
    scale = torch.full((1,), 1024.0, device=device)
    for s in range(5):
        grads = step_grads(params, s)
        set_grads(params, grads)
        opt.step()
        set_grads(scaled, [g * 1024 for g in grads])
        opt_scaled.step(grad_scale=scale)
        for p, q in zip(params, scaled):
            assert torch.equal(q.grad, p.grad), "the unscaled grads are written back"
    for a, b in zip(params, scaled):
        assert torch.equal(a, b)


def check_a_torch_grad_scaler_drives_it(make, shapes, device):
    params = make_params(shapes, torch.float32, device)
    plain = clone_params(params)
    opt, opt_plain = make(params), make(plain)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 12)
    for s in range(3):
        grads = step_grads(params, s)
        # d/dp of sum(p * g) is g: backward of the scaled loss leaves g * scale in p.grad.
        loss = sum((p * g).sum() for p, g in zip(params, grads))
        scaler.scale(loss).backward()
        scaler.step(opt)
        opt.zero_grad()
        scaler.update()
        set_grads(plain, grads)
        opt_plain.step()
    for a, b in zip(params, plain):
        assert torch.equal(a, b)


def check_skip_nonfinite_leaves_everything_as_it_was(make, state_keys, device, bad, position,
                                                     dtype=torch.float16, master_weights=True):
    """A step whose grads hold `bad` at the first, a middle or the last element of a
    three-chunk tensor writes no param and no state (`state_keys` of each param's state, its
    step, and the master or the bf16 mode's compensation or low half that `master_weights`
    keeps for `dtype` params)."""
    params = make_params([(100,), (65537,), (9,)], dtype, device)
    opt = make(params, master_weights=master_weights, skip_nonfinite=True)
    set_grads(params, step_grads(params, 0))
    opt.step()
    extra = EXTRA_KEYS.get(param_mode(master_weights, params[0]))
    keys = (*state_keys, "step", *([extra] if extra else []))
    before = {k: [opt.state[p][k].clone() for p in params] for k in keys}
    values = [p.detach().clone() for p in params]
    grads = step_grads(params, 1)
    index = {"first": 0, "middle": grads[1].numel() // 2, "last": grads[1].numel() - 1}[position]
    grads[1][index] = bad
    set_grads(params, grads)
    opt.step()
    assert bool(opt.last_step_skipped)
    for p, value in zip(params, values):
        assert torch.equal(p.detach(), value)
    for key, tensors in before.items():
        for p, t in zip(params, tensors):
            assert torch.equal(opt.state[p][key], t), key


def check_compiled_steps_match_eager(make, shapes, device, backend):
    """A torch.compile(fullgraph=True) step gives the eager step's bits, masters and bf16 params
    alike."""
    # Every optimizer's check compiles this same function (one code object): without a reset,
    # the optimizers tested before would use up Dynamo's recompile limit.
    torch._dynamo.reset()
    params = make_params(shapes, torch.bfloat16, device)
    eager = clone_params(params)
    opts = [make(p, master_weights=True) for p in (params, eager)]

    @torch.compile(backend=backend, fullgraph=True)
    def compiled_step():
        opts[0].step()

    for s in range(4):
        grads = step_grads(params, s, scale=5.0)
        set_grads(params, grads)
        set_grads(eager, grads)
        compiled_step()
        opts[1].step()
    for a, b in zip(params, eager):
        assert torch.equal(a, b)


def train_tiny_mlp(make, opt_level=None, steps=30):
    """The model, optimizer and losses of a small regression trained plain in fp32 or under amp
    (bf16)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = make(model.parameters())
    if opt_level is not None:
        model, opt = ampfuse.amp.initialize(model, opt, opt_level=opt_level,
                                            dtype=torch.bfloat16, verbosity=0)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if opt_level is None:
            loss.backward()
        else:
            with ampfuse.amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def check_amp_trains_like_fp32(make, opt_level, steps=30):
    """The loss falls by a fifth in fp32, amp's run ends within 5% of it, and at O2 the bf16
    params are their fp32 masters rounded."""
    _, _, fp32 = train_tiny_mlp(make, steps=steps)
    model, opt, losses = train_tiny_mlp(make, opt_level, steps)
    assert fp32[-1] < 0.8 * fp32[0], fp32
    assert abs(losses[-1] - fp32[-1]) < 0.05 * fp32[-1], (losses[-1], fp32[-1])
    if opt_level == "O2":
        p = model[0].weight
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), opt.state[p]["master_param"].to(torch.bfloat16))


def check_dtensor_params_step_like_plain_ones(make, grad_scale=1.0, dtype=torch.float32):
    """Params sharded as DTensors on a one-rank mesh step to the same bits as plain ones (the
    caller's `one_rank` fixture makes the process group); returns (plain, sharded, optimizers)
    for checks of the caller's own. Two ranks: test_fsdp2.py."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    plain = make_params([(6, 3), (5,)], dtype, "cpu")
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
               for p in plain]
    opts = [make(ps) for ps in (plain, sharded)]
    for s in range(3):
        grads = step_grads(plain, s, scale=grad_scale)
        set_grads(plain, grads)
        for p, g in zip(sharded, grads):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        for opt in opts:
            opt.step()
    for p, q in zip(plain, sharded):
        assert torch.equal(p.detach(), q.detach().full_tensor())
    return plain, sharded, opts


def check_dtensor_state_is_the_plain_state(plain, sharded, opts):
    """After check_dtensor_params_step_like_plain_ones: every state tensor of the sharded run is
    the plain run's. One rank: the local shard is the whole tensor (gloo gathers no int16)."""
    for p, q in zip(plain, sharded):
        for key, value in opts[0].state[p].items():
            other = opts[1].state[q][key]
            assert torch.equal(value, other.to_local() if hasattr(other, "to_local")
                               else other), key


def check_split_steps_exactly_as_fp32_masters(make, state_keys, shapes, device):
    """`make(params, master_weights)`: over five steps of grads of norm ~800, "split"'s masters
    and `state_keys` of each param's state are True's bit for bit; the param is the master
    rounded (split_halves: True's param but at an even tie)."""
    params = make_params(shapes, torch.bfloat16, device)
    twin = clone_params(params)
    opts = (make(params, True), make(twin, "split"))
    for s in range(5):
        grads = step_grads(params, s, scale=3.0)
        for ps, opt in zip((params, twin), opts):
            set_grads(ps, grads)
            opt.step()
        for i, (p, q) in enumerate(zip(params, twin)):
            want, got = opts[0].state[p], opts[1].state[q]
            assert_close_report(precise_value(q, got), want["master_param"], exact=True,
                                msg=f"step {s}: master {i}")
            for key in state_keys:
                assert_close_report(got[key], want[key], exact=True, msg=f"step {s}: {key} {i}")
    for p, q in zip(params, twin):
        high, _ = split_halves(opts[0].state[p]["master_param"])
        assert torch.equal(q.detach().view(torch.int16), high)


def check_cuda_steps_are_the_cpu_steps(make):
    """`make(params)` (one bf16 mode): three steps on the GPU give the CPU's params and state
    bit for bit."""
    params = make_params([(300,), (65537,), (4, 5)], torch.bfloat16, "cpu")
    on_cuda = [p.detach().cuda().requires_grad_() for p in params]
    optimizers = [make(ps) for ps in (params, on_cuda)]
    for s in range(3):
        for ps, optimizer in zip((params, on_cuda), optimizers):
            set_grads(ps, step_grads(ps, s))
            optimizer.step()
    for i, (c, g) in enumerate(zip(params, on_cuda)):
        assert_close_report(g.detach().cpu(), c.detach(), exact=True, msg=f"param {i}")
        for key, value in optimizers[0].state[c].items():
            assert_close_report(optimizers[1].state[g][key].cpu(), value, exact=True,
                                msg=f"{key} of param {i}")


def check_bad_options_are_refused_by_name(cls, options, patterns):
    """cls(params, **options) raises naming every pattern; with patterns None the options are a
    key of another optimizer, which a param group must not carry."""
    params = make_params([(4,)], torch.float32, "cpu")
    if patterns is None:
        with raises_naming(next(iter(options)), "does not have"):
            cls([{"params": params, **options}])
        return
    with raises_naming(*patterns):
        cls(params, **options)
