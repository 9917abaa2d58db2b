"""An FP8 Linear inside FSDP2's fully_shard on two CPU processes (gloo) trains like the
unsharded layer: each rank all-gathers the bf16 weight, quantizes it in each forward (a
fully_shard unit caches no FP8 weight: that would keep the whole layer alive between
micro-batches) and its FP8 GEMMs see the same values as the single-process run. Every rank
trains on the same batches, so FSDP2's averaged gradients are the single-process ones."""

import ampfuse
import pytest
import torch
import torch.nn.functional as F
from ampfuse import fp8
from ranks import run_on_ranks
from torch import nn

WORLD_SIZE = 2
STEPS = 3
MICRO_BATCHES = 2
TIMEOUT_S = 90


def _model(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    fp8.convert(model, recipe, min_features=0)
    return model


def _batch(step, micro):
    generator = torch.Generator().manual_seed(100 + 10 * step + micro)
    return (torch.randn(16, 32, generator=generator).to(torch.bfloat16),
            torch.randn(16, 32, generator=generator))


def _train(recipe, sharded):
    model = _model(recipe)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    optimizer = ampfuse.optimizers.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                              master_weights=True)
    losses = []
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            inputs, targets = _batch(step, micro)
            loss = F.mse_loss(model(inputs).float(), targets)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    params = [p.detach() for p in model.parameters()]
    if sharded:
        params = [p.full_tensor() for p in params]
        assert all(isinstance(m, fp8.Linear) for m in (model[0], model[2]))
        # A fully_shard unit keeps no FP8 copy of its all-gathered weight between forwards.
        assert not model[0]._fp8_weight_cache.holds
    return {"params": params, "losses": torch.stack(losses)}


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.RowwiseScaling()],
                         ids=["current", "rowwise"])
def test_fully_shard_fp8_linear_trains_like_unsharded(tmp_path, recipe):
    ranks = run_on_ranks(_train, recipe, True, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S,
                         out_dir=tmp_path)  # _train(recipe, sharded=True) on each rank
    expected = _train(recipe, sharded=False)
    for result in ranks:
        torch.testing.assert_close(result["losses"], expected["losses"], rtol=1e-6, atol=1e-7)
        for i, (got, want) in enumerate(zip(result["params"], expected["params"])):
            # bf16 params: the same bits, or one bf16 rounding apart where FSDP2's averaged
            # gradient rounds differently.
            torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-6, msg=f"param {i}")
