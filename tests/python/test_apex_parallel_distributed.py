"""apex.parallel.distributed on the alias: flat_dist_call, Reducer and the flatten helpers, as
NVIDIA's BERT scripts use them (``flat_dist_call([p.data for p in model.parameters()],
dist.broadcast, (0,))`` to start every rank from rank 0's weights), on two gloo ranks."""

import torch
import torch.distributed as dist
from ampfuse.apex_compat.apex import parallel as apex_parallel
from ampfuse.apex_compat.apex.parallel import distributed as apex_distributed
from ranks import run_on_ranks


def _values(rank):
    """Tensors of three types and odd shapes, filled with rank + 1 (plus their position)."""
    shapes_and_dtypes = [((3, 2), torch.float32), ((5,), torch.float16), ((2, 2), torch.float64),
                         ((1,), torch.float32), ((4,), torch.float16)]
    return [torch.arange(torch.Size(shape).numel(), dtype=dtype).reshape(shape) + (rank + 1)
            for shape, dtype in shapes_and_dtypes]


class _TwoDtypes(torch.nn.Module):
    """fp32 and fp64 params, so that the broadcast and the reduce each take two buckets."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 3)
        self.second = torch.nn.Linear(3, 2).double()

    def forward(self, x):
        return self.second(self.first(x).double())


def _model(rank):
    torch.manual_seed(rank)  # different weights on each rank until the Reducer broadcasts
    return _TwoDtypes()


def _reduce_and_broadcast():
    rank = dist.get_rank()
    results = {}
    reduced = _values(rank)
    apex_distributed.flat_dist_call(reduced, dist.all_reduce)
    results["all_reduce"] = reduced
    broadcast = _values(rank)
    apex_distributed.flat_dist_call(broadcast, dist.broadcast, (0,))
    results["broadcast"] = broadcast

    model = _model(rank)
    reducer = apex_parallel.Reducer(model)  # broadcasts rank 0's weights
    results["weights"] = [p.detach().clone() for p in model.parameters()]
    model(torch.full((2, 4), float(rank + 1))).float().sum().backward()
    results["local_grads"] = [p.grad.clone() for p in model.parameters()]
    reducer.reduce()
    results["reduced_grads"] = [p.grad.clone() for p in model.parameters()]

    listed = _values(rank)
    apex_distributed.Reducer([listed[:2], (listed[2], [listed[3:]])]).reduce()
    results["reducer_list"] = listed
    return results


def test_flat_dist_call_and_reducer_on_two_ranks(tmp_path):
    ranks = run_on_ranks(_reduce_and_broadcast, world_size=2, timeout_s=90, out_dir=tmp_path,
                         collective_timeout_s=30)
    mean = [(a + b) / 2 for a, b in zip(_values(0), _values(1))]
    for result in ranks:
        # all_reduce averages (apex divided by the world size after it), dtype by dtype.
        for got, want in zip(result["all_reduce"], mean):
            assert got.dtype == want.dtype and torch.equal(got, want)
        for got, want in zip(result["reducer_list"], mean):
            assert torch.equal(got, want)
        # broadcast leaves rank 0's values everywhere and is not divided.
        for got, want in zip(result["broadcast"], _values(0)):
            assert torch.equal(got, want)
        for got, want in zip(result["weights"], _model(0).parameters()):
            assert torch.equal(got, want.detach())
    # The module's grads: each rank's own before reduce(), their mean after.
    assert not torch.equal(ranks[0]["local_grads"][0], ranks[1]["local_grads"][0])
    for i, (g0, g1) in enumerate(zip(ranks[0]["local_grads"], ranks[1]["local_grads"])):
        for result in ranks:
            torch.testing.assert_close(result["reduced_grads"][i], (g0 + g1) / 2, rtol=0,
                                       atol=1e-6, msg=f"grad {i}")


def test_flatten_helpers_and_type_split():
    tensors = _values(0) + [torch.zeros(0)]
    flat = apex_distributed.flatten([tensors[0], tensors[3]])
    assert flat.shape == (7,) and flat.dtype == torch.float32
    views = apex_distributed.unflatten(flat, [tensors[0], tensors[3]])
    assert [v.shape for v in views] == [(3, 2), (1,)]
    buckets = apex_distributed.split_by_type(tensors)
    assert list(buckets) == ["torch.FloatTensor", "torch.HalfTensor", "torch.DoubleTensor"]
    assert [len(b) for b in buckets.values()] == [3, 2, 1]
    # apex's CUDA-only split: no CPU tensor is in it.
    assert apex_distributed.split_half_float_double(tensors) == []
    found = []
    apex_distributed.extract_tensors([tensors[0], ("x", [tensors[1], None, 3])], found)
    assert [id(t) for t in found] == [id(tensors[0]), id(tensors[1])]


def test_the_alias_serves_apexs_module_paths():
    from ampfuse.apex_compat import _MODULES

    assert _MODULES["apex.parallel.distributed"] == apex_distributed.__name__
    for sub in ("sync_batchnorm", "optimized_sync_batchnorm"):
        assert _MODULES[f"apex.parallel.{sub}"] == apex_parallel.__name__
    assert apex_distributed.DistributedDataParallel is apex_parallel.DistributedDataParallel
    assert apex_parallel.Reducer is apex_distributed.Reducer
