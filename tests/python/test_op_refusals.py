"""Tensors no ampfuse kernel takes (sparse, quantized, mkldnn, nested) get ampfuse's own error
naming the tensor and the fix, from every op, never the dispatcher's "Could not run
'ampfuse::...' with arguments from the 'SparseCPU' backend"."""

import re

import pytest
import torch

import ampfuse  # noqa: F401  (registers torch.ops.ampfuse)

ops = torch.ops.ampfuse


def _dense():
    return torch.randn(4, 4)


def _kinds():
    d = _dense()
    return {
        "sparse_coo": (d.to_sparse(), "sparse COO"),
        "sparse_csr": (d.to_sparse_csr(), "sparse tensor of layout"),
        "mkldnn": (d.to_mkldnn(), "mkldnn"),
        "quantized": (torch.quantize_per_tensor(d, 0.1, 0, torch.qint8), "quantized"),
        "nested": (torch.nested.nested_tensor([torch.randn(3), torch.randn(2)],
                                              layout=torch.jagged), "nested"),
    }


# Where _call puts the unsupported tensor, as the error must name it.
LABELS = {"multi_tensor_unscale_": r"grads\[1\]", "multi_tensor_scale_": r"src\[1\]",
          "multi_tensor_l2norm": r"tensors\[1\]", "update_scale_": "scale",
          "fused_adam_": r"grads\[1\]", "fused_sgd_": r"grads\[1\]"}


def _call(op, bad):
    """Calls `op` with `bad` as the second tensor of its main list (or as its scale)."""
    scalar = torch.ones(1)
    if op == "multi_tensor_unscale_":
        ops.multi_tensor_unscale_([_dense(), bad], torch.zeros(1), scalar)
    if op == "multi_tensor_scale_":
        ops.multi_tensor_scale_([_dense(), bad], [_dense(), _dense()], scalar, torch.zeros(1))
    if op == "multi_tensor_l2norm":
        ops.multi_tensor_l2norm([_dense(), bad], True)
    if op == "update_scale_":
        ops.update_scale_(bad, torch.zeros(1, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 10, 1,
                          0.0, 1e9)
    zeros = [torch.zeros(4, 4), torch.zeros(4, 4)]
    if op == "fused_adam_":
        ops.fused_adam_([_dense(), _dense()], [_dense(), bad], zeros, zeros, [], [],
                        torch.zeros(()), torch.full((), 0.1), 0.9, 0.999, 1e-8, 0.0, True, True,
                        False, False, None, None)
    else:
        ops.fused_sgd_([_dense(), _dense()], [_dense(), bad], [], [], torch.zeros(()),
                       torch.full((), 0.1), 0.0, 0.0, 0.0, False, False, None, None)


OPS = ["multi_tensor_unscale_", "multi_tensor_scale_", "multi_tensor_l2norm", "update_scale_",
       "fused_adam_", "fused_sgd_"]
FIXES = {
    ("sparse_coo", "multi_tensor_unscale_"): r"coalesce\(\).*_values\(\)",
    ("sparse_coo", "multi_tensor_l2norm"): r"coalesce\(\).*_values\(\)",
    ("sparse_csr", "multi_tensor_scale_"): r"t\.values\(\)",
    ("sparse_coo", "fused_adam_"): "SparseAdam",
    ("sparse_csr", "fused_sgd_"): "SparseAdam",
    ("sparse_coo", "update_scale_"): r"to_dense\(\)",
    ("mkldnn", None): r"to_dense\(\)",
    ("quantized", None): r"dequantize\(\)",
    ("nested", None): r"unbind\(\)",
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "mkldnn", "quantized", "nested"])
@pytest.mark.parametrize("op", OPS)
def test_unsupported_tensor_kinds_get_ampfuse_errors(op, kind):
    bad, what = _kinds()[kind]
    with pytest.raises(RuntimeError) as info:
        _call(op, bad)
    message = str(info.value)
    assert "Could not run" not in message, message
    assert re.search(rf"ampfuse\.{op}: {LABELS[op]} is an? [^;]*{what}", message), message
    fix = FIXES.get((kind, op), FIXES.get((kind, None)))
    if fix is not None:
        assert re.search(fix, message), message
