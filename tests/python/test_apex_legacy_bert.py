"""apex 0.1's mixed-precision recipe as pytorch-pretrained-BERT's fine-tuning scripts (and the
many copied from them) write it: ``from apex.optimizers import FP16_Optimizer, FusedAdam``,
FusedAdam(..., bias_correction=False, max_grad_norm=1.0) wrapped in FP16_Optimizer, the lr
set through param_groups. On the alias FusedAdam clips each group by its grads' norm inside the
step, and FP16_Optimizer is apex.fp16_utils'."""

import pickle

import pytest
import torch

from ampfuse.apex_compat.apex import fp16_utils
from ampfuse.apex_compat.apex.optimizers import FP16_Optimizer, FusedAdam
from helpers import raises_naming
from test_adam import assert_parity


def _params(seed, shapes=((40,), (9, 3))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 2) for s in shapes]


def test_max_grad_norm_clips_each_group_like_clip_grad_norm():
    """Two groups, each clipped by its own norm (one is below the bound and stays), against
    torch.nn.utils.clip_grad_norm_ per group followed by the unclipped FusedAdam."""
    ours, theirs = _params(0), _params(0)
    clipped = FusedAdam([{"params": ours[:1]}, {"params": ours[1:], "max_grad_norm": 100.0}],
                        lr=0.05, bias_correction=False, max_grad_norm=1.0)
    plain = FusedAdam([{"params": theirs[:1]}, {"params": theirs[1:]}], lr=0.05,
                      bias_correction=False)
    assert clipped.param_groups[1]["max_grad_norm"] == 100.0
    for step in range(5):
        gen = torch.Generator().manual_seed(100 + step)
        grads = [torch.randn(p.shape, generator=gen) * 5 for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_(theirs[:1], 1.0)
        torch.nn.utils.clip_grad_norm_(theirs[1:], 100.0)
        clipped.step()
        plain.step()
    for p, q in zip(ours, theirs):
        assert_parity(p, q, "clipped FusedAdam")


def test_the_clip_divides_out_a_loss_scale_too():
    ours, scaled = _params(1), _params(1)
    opts = [FusedAdam(ps, lr=0.05, max_grad_norm=0.5) for ps in (ours, scaled)]
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, q, g in zip(ours, scaled, grads):
            p.grad, q.grad = g.clone(), g * 1024
        opts[0].step()
        opts[1].step(grad_scale=torch.full((1,), 1024.0))
    for p, q in zip(ours, scaled):
        assert torch.equal(p, q)


def test_clipping_compiles_and_survives_pickling():
    ours, compiled = _params(2), _params(2)
    eager_opt = FusedAdam(ours, lr=0.05, max_grad_norm=1.0)
    compiled_opt = FusedAdam(compiled, lr=0.05, max_grad_norm=1.0)
    torch._dynamo.reset()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled_step():
        compiled_opt.step()

    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) * 5 for p in ours]
        for p, q, g in zip(ours, compiled, grads):
            p.grad, q.grad = g.clone(), g.clone()
        eager_opt.step()
        compiled_step()
    for p, q in zip(ours, compiled):
        assert torch.equal(p, q)
    copy = pickle.loads(pickle.dumps(eager_opt))
    copy.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert copy.param_groups[-1]["max_grad_norm"] == 1.0


def _bert_like_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.LayerNorm(32), torch.nn.Linear(32, 2)).half()


def test_the_bert_fine_tuning_recipe_trains_and_skips_an_overflow():
    model = _bert_like_model()
    no_decay = ("bias", "LayerNorm.weight", "2.weight")
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = FusedAdam(groups, lr=5e-3, bias_correction=False, max_grad_norm=1.0)
    optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, verbose=False)
    gen = torch.Generator().manual_seed(3)
    x, labels = torch.randn(32, 16, generator=gen), torch.randint(0, 2, (32,), generator=gen)
    losses = []
    for step in range(40):
        loss = torch.nn.functional.cross_entropy(model(x.half()).float(), labels)
        optimizer.backward(loss)
        lr_this_step = 5e-3 * (1 - step / 40)
        for group in optimizer.param_groups:
            group["lr"] = lr_this_step
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fp16_utils.to_python_float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    before = [p.clone() for p in model.parameters()]
    scale = optimizer.loss_scale
    optimizer.backward(model(x.half()).float().sum() * float("inf"))
    optimizer.step()
    assert optimizer.loss_scale == scale / 2
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("options,patterns", [
    ({"eps_inside_sqrt": True}, ["eps_inside_sqrt", "sqrt\\(v\\) \\+ eps"]),
    ({"max_grad_norm": -1.0}, ["max_grad_norm=-1.0", ">= 0"]),
])
def test_unsupported_legacy_options_are_refused_by_name(options, patterns):
    with raises_naming(*patterns):
        FusedAdam(_params(0), **options)


def test_the_contrib_optimizers_import_line_gives_the_same_classes():
    """Later BERT derivatives import FP16_Optimizer (and FusedAdam) from apex.contrib.optimizers,
    where apex moved them; DistributedFusedAdam names its FSDP2 replacement."""
    from ampfuse.apex_compat import install_apex_alias, uninstall_apex_alias

    install_apex_alias()
    try:
        from apex.contrib.optimizers import FP16_Optimizer as Contrib16
        from apex.contrib.optimizers import FusedAdam as ContribAdam
        from apex.contrib.optimizers.fp16_optimizer import FP16_Optimizer as Deep16

        assert Contrib16 is Deep16 is FP16_Optimizer and ContribAdam is FusedAdam
        with pytest.raises(ImportError, match="FSDP2.*ampfuse.optimizers.FusedAdam"):
            from apex.contrib.optimizers import DistributedFusedAdam  # noqa: F401
        with pytest.raises(ModuleNotFoundError, match="FSDP2"):
            import apex.contrib.optimizers.distributed_fused_adam  # noqa: F401
    finally:
        uninstall_apex_alias()
