"""ampfuse.GradScaler with found_inf all-reduced over a process group: two gloo processes with
the same data and model, where only rank 1 overflows. With the flag all-reduced (the default
group, or a group of ours) both ranks skip that step and back off, so params and scales stay
identical; without it (the control) the ranks diverge. The model and loop are
test_grad_scaler's."""

import math

import torch
import torch.distributed as dist
from ampfuse.scaling.grad_scaler import GradScaler
from ranks import run_on_ranks
from test_grad_scaler import OPTIMIZERS, make_batches, make_model, train
from tolerances import assert_close_report

DIST_STEPS = 6
DIST_OVERFLOW_STEP = 3


def _found_inf_variants():
    rank = dist.get_rank()
    results = {}
    variants = {
        "sgd_default_group": (OPTIMIZERS["sgd"], {"all_reduce_found_inf": True}),
        "fused_adam_group": (OPTIMIZERS["ampfuse_fused_adam"],
                             {"process_group": dist.new_group([0, 1])}),
        "sgd_not_reduced": (OPTIMIZERS["sgd"], {}),
    }
    batches = make_batches("cpu", DIST_STEPS)  # the same data on both ranks
    for name, (make_optimizer, extra) in variants.items():
        model = make_model("cpu")
        opt = make_optimizer(list(model.parameters()))
        scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=100, **extra)
        # Only rank 1 sees an overflow.
        overflows = {DIST_OVERFLOW_STEP: (0, 0, math.inf)} if rank == 1 else {}
        scales = train(model, opt, scaler, batches, overflows)
        results[name] = (scales, [p.detach().clone() for p in model.parameters()])
    return results


def test_found_inf_is_all_reduced_across_ranks(tmp_path):
    """2 gloo processes, same data and model; rank 1 alone injects an inf. With the flag
    all-reduced both ranks skip that step and back off, so params and scales stay identical;
    without it (the control) the ranks diverge."""
    ranks = run_on_ranks(_found_inf_variants, world_size=2, timeout_s=60, out_dir=tmp_path,
                         collective_timeout_s=30)
    backed_off = [2.0**10] * DIST_OVERFLOW_STEP + [2.0**9] * (DIST_STEPS - DIST_OVERFLOW_STEP)
    for name in ("sgd_default_group", "fused_adam_group"):
        (scales0, params0), (scales1, params1) = ranks[0][name], ranks[1][name]
        assert scales0 == scales1 == backed_off, name
        for i, (p, q) in enumerate(zip(params0, params1)):
            assert_close_report(p, q, exact=True, msg=f"{name}: params[{i}], rank 0 vs 1")
    (scales0, params0), (scales1, params1) = (r["sgd_not_reduced"] for r in ranks)
    assert scales0 == [2.0**10] * DIST_STEPS and scales1 == backed_off
    assert not torch.equal(params0[0], params1[0])
