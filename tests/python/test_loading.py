"""The package loads, says where its kernels can run, and registers the four ops as specified."""

import ampfuse
import pytest
import torch

SCHEMAS = {
    "multi_tensor_unscale_": (
        "ampfuse::multi_tensor_unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, "
        "Tensor inv_scale, Tensor(c!)? tensor_flags=None) -> ()"
    ),
    "multi_tensor_scale_": (
        "ampfuse::multi_tensor_scale_(Tensor[] src, Tensor(a!)[] dst, Tensor scale, "
        "Tensor(b!) found_inf, Tensor(c!)? tensor_flags=None) -> ()"
    ),
    "multi_tensor_l2norm": (
        "ampfuse::multi_tensor_l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)"
    ),
    "update_scale_": (
        "ampfuse::update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, "
        "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval, int hysteresis, float min_scale, "
        "float max_scale) -> ()"
    ),
}


def test_cuda_available_is_a_bool_that_agrees_with_torch():
    available = ampfuse.cuda_available()
    assert isinstance(available, bool)
    if not torch.cuda.is_available():
        assert available is False


def test_cuda_status_explains_itself():
    status = ampfuse.cuda_status()
    assert isinstance(status, str) and status.strip()
    if not ampfuse.cuda_available():
        # Without usable kernels the text must say why: no device, or no CUDA kernels built.
        lowered = status.lower()
        assert "cuda" in lowered and any(w in lowered for w in ("no ", "not ", "without")), status


@pytest.mark.cuda
def test_cuda_kernels_are_available_on_a_gpu_machine():
    assert ampfuse.cuda_available() is True, ampfuse.cuda_status()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_op_is_registered_with_its_schema(name):
    packet = getattr(torch.ops.ampfuse, name)
    assert packet.default._schema == torch._C.parse_schema(SCHEMAS[name]), str(
        packet.default._schema
    )


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_op_has_cpu_kernel(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ampfuse::{name}", "CPU")


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_op_has_cuda_kernel(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ampfuse::{name}", "CUDA")


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_python_wrapper_is_exported(name):
    assert callable(getattr(ampfuse, name))
