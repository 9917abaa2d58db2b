"""The apex alias's apex.contrib.clip_grad.clip_grad_norm_ (MONAI's and NVIDIA's training
scripts import it): torch.nn.utils.clip_grad_norm_'s result with the fused norm and scale."""

import pytest
import torch

from ampfuse.apex_compat.apex.contrib.clip_grad import clip_grad_norm_


def _params(dtypes=(torch.float32, torch.float16, torch.bfloat16), scale=3.0):
    gen = torch.Generator().manual_seed(0)
    params = []
    for i, dtype in enumerate(dtypes):
        p = torch.nn.Parameter(torch.zeros(17 + 40 * i, dtype=dtype))
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "below_the_bound"])
def test_clips_by_the_float64_norm_of_every_grad(max_norm):
    """The norm is taken in fp32 over every grad (torch's takes each fp16/bf16 grad's norm in
    its own dtype first, so it may differ in the fifth digit): against float64."""
    params, start = _params(), _params()
    total = clip_grad_norm_(params, max_norm)
    exact = sum(float(p.grad.double().square().sum()) for p in start) ** 0.5
    torch.testing.assert_close(float(total), exact, rtol=1e-6, atol=0)
    coef = min(1.0, max_norm / (exact + 1e-6))
    for p, q in zip(params, start):
        expected = (q.grad.double() * coef).to(q.dtype)
        if coef == 1.0:
            assert torch.equal(p.grad, q.grad), "below the bound the grads stay as they were"
        tol = 1e-6 if p.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(p.grad.float(), expected.float(), rtol=tol, atol=tol)


def test_fp32_grads_match_torch_clip_grad_norm():
    ours, theirs = _params((torch.float32,) * 3), _params((torch.float32,) * 3)
    total = clip_grad_norm_(ours, 0.5)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(theirs, 0.5), rtol=1e-6,
                               atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_other_norms_and_no_grads_follow_torch():
    ours, theirs = _params(), _params()
    assert torch.equal(clip_grad_norm_(ours, 1.0, norm_type=float("inf")),
                       torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=float("inf")))
    assert float(clip_grad_norm_([torch.nn.Parameter(torch.zeros(3))], 1.0)) == 0.0


def test_a_nonfinite_norm_raises_only_when_asked():
    params = _params()
    params[1].grad[3] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    assert torch.isinf(clip_grad_norm_(params, 1.0))


def test_other_contrib_packages_still_name_their_replacement():
    from ampfuse.apex_compat import install_apex_alias, uninstall_apex_alias

    install_apex_alias()
    try:
        from apex.contrib.clip_grad import clip_grad_norm_ as aliased

        assert aliased is clip_grad_norm_
        with pytest.raises(ModuleNotFoundError, match="only clip_grad and optimizers"):
            import apex.contrib.sparsity  # noqa: F401
    finally:
        uninstall_apex_alias()
