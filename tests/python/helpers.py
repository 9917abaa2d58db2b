"""Data builders, references and error checks shared by the op tests."""

import contextlib
import pathlib
import re

import ampfuse
import pytest
import torch

# The folder ampfuse was imported from: site-packages for an installed wheel (how `make test`
# runs), python/ of the checkout for a source build. Tests that start a Python of their own put
# it on PYTHONPATH, so the child tests the same ampfuse as the test process.
AMPFUSE_PATH = str(pathlib.Path(ampfuse.__file__).resolve().parents[1])

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_IDS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}

CHUNK = 65536
# Sizes on both sides of the 64K-element chunk the kernels split work into.
CHUNK_SIZES = (0, 1, 65535, CHUNK, CHUNK + 1, 3 * CHUNK + 7)
# Dtypes no op accepts: integers, bool, complex, and float64 (the ops are fp32/fp16/bf16 only).
BAD_DTYPES = (torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float64)

# Where the non-finite value goes: index of the tensor in the list / of the element in it.
POSITIONS = ("first", "middle", "last")
NON_FINITE = (float("inf"), float("-inf"), float("nan"))
# Sizes of the list that inf/nan are injected into: the middle tensor spans three chunks.
INJECTION_SIZES = (CHUNK + 1, 3, 2 * CHUNK + 5, 1, CHUNK + 100)


def torch_scaler_class(device, dtype):
    """The GradScaler a test drives the optimizer with: torch's, except for bf16 grads on CUDA,
    which torch's CUDA unscale kernel does not take (NotImplementedError for 'BFloat16' in
    torch 2.11); ampfuse.GradScaler keeps torch's protocol and takes them."""
    if torch.device(device).type == "cuda" and dtype == torch.bfloat16:
        import ampfuse

        return ampfuse.GradScaler
    return torch.amp.GradScaler


def dtype_id(dtype):
    return DTYPE_IDS.get(dtype, str(dtype).replace("torch.", ""))


def position_index(position, n):
    return {"first": 0, "middle": n // 2, "last": n - 1}[position]


def other_device(device):
    """A device that differs from `device` and needs no GPU when `device` is the CPU."""
    return "meta" if device == "cpu" else "cpu"


def make_generator(seed):
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def random_values(shape, dtype, device, gen, magnitude=100.0):
    """Normal values times `magnitude`, never all zeros, made on the CPU so CPU and CUDA runs see
    the same numbers, then moved to `device`."""
    if isinstance(shape, int):
        shape = (shape,)
    values = torch.randn(shape, generator=gen, dtype=torch.float32) * magnitude
    return values.to(dtype).to(device)


# More tensors than one CUDA launch takes at any depth (1268 at depth 1, the largest cap), twice.
MANY_TENSORS = 2600
# Chunks one CUDA launch covers (8192 blocks of one chunk each).
BLOCKS_PER_LAUNCH = 8192


def chunks_past_the_block_cap(device):
    """A tensor size in chunks that needs two CUDA launches; on the CPU, where there are no
    launches, a smaller tensor that still spans many of the CPU's 64K-element spans."""
    return BLOCKS_PER_LAUNCH + 1 if torch.device(device).type == "cuda" else 321


def mixed_shapes(count, gen):
    """`count` shapes drawn from a pool of empty, scalar, tiny, chunk-straddling and 2-D
    shapes. A list of MANY_TENSORS draws only tiny shapes: it outruns every per-launch tensor
    cap without costing time."""
    if count == MANY_TENSORS:
        pool = [(), (0,), (1,), (3,), (17,), (2, 5)]
    else:
        pool = [(), (0,), (1,), (7,), (4099,), (CHUNK - 1,), (CHUNK + 1,), (3, 5), (0, 4),
                (129, 513)]
    picks = torch.randint(len(pool), (count,), generator=gen).tolist()
    return [pool[p] for p in picks]


def random_list(sizes, dtypes, device, gen, magnitude=100.0):
    """One tensor per size; dtypes is one dtype or a sequence cycled over the list."""
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    return [
        random_values(size, dtypes[i % len(dtypes)], device, gen, magnitude)
        for i, size in enumerate(sizes)
    ]


class Guarded:
    """A 1-D view of `n` elements inside a buffer whose other elements are NaN.

    offset=1 puts the view one element into the buffer, so its data pointer is not 16-byte
    aligned. A kernel that writes past either end changes a guard; one that reads past the end
    and checks for non-finite values sees a NaN and raises found_inf, or yields a NaN norm.
    """

    def __init__(self, values, offset):
        n = values.numel()
        self.offset = offset
        self.n = n
        self.base = torch.full(
            (n + offset + 1,), float("nan"), dtype=values.dtype, device=values.device
        )
        self.view = self.base[offset : offset + n]
        self.view.copy_(values.reshape(-1))

    def assert_guards_intact(self):
        guards = torch.cat([self.base[: self.offset], self.base[self.offset + self.n :]])
        assert bool(torch.isnan(guards).all()), "an element outside the view was written"


def mul_fp32(x, scale, out_dtype):
    """x times scale with one fp32 rounding, then a cast to out_dtype: what the ops compute.

    fp32 x fp32 products are exact in float64 (24 + 24 bits < 53), so rounding the float64
    product to fp32 is exactly the fp32 multiplication.
    """
    s = scale.double().cpu().reshape(())
    return (x.detach().cpu().double() * s).float().to(out_dtype)


def mul_f64(x, scale, out_dtype):
    """The float64 reference: x times scale rounded once, to out_dtype."""
    s = scale.double().cpu().reshape(())
    return (x.detach().cpu().double() * s).to(out_dtype)


def scalar_tensor(value, device, dtype=torch.float32):
    return torch.full((1,), value, dtype=dtype, device=device)


def non_dense_2d(dtype, device, gen):
    """A (8, 6) view of every other column of an (8, 12) tensor: neither contiguous nor dense."""
    return random_values((8, 12), dtype, device, gen)[:, ::2]


ERRORS = (RuntimeError, ValueError)


@contextlib.contextmanager
def raises_naming(*patterns):
    """Expects a RuntimeError or ValueError whose message matches every regex in `patterns`
    (the argument's name, a list index, a reason such as "contiguous")."""
    with pytest.raises(ERRORS, match=patterns[0]) as info:
        yield info
    message = str(info.value)
    for pattern in patterns[1:]:
        assert re.search(pattern, message), f"error message {message!r} does not match {pattern!r}"


def filled(shape, dtype, device):
    """A tensor of any dtype, integer and complex included, with nonzero entries."""
    return torch.ones(shape, dtype=dtype, device=device)


def clone_args(args):
    """A copy of an op test's arguments: a dict of tensors and lists of tensors."""
    return {k: [t.clone() for t in v] if isinstance(v, list) else v.clone()
            for k, v in args.items()}


def assert_lists_equal(a, b, keys):
    """torch.equal on every tensor of a[key] against b[key]'s (moved to its device), for each
    key (dicts of tensor lists, as the optimizer-op tests build them)."""
    for key in keys:
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert torch.equal(x, y.to(x.device)), f"{key}[{i}]"


def call_with_one_and_more_threads(call, one, more):
    """call(one) with one CPU thread and call(more) with at least two (the caller compares
    them: a CPU op's result must not depend on how its spans are spread over threads)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        call(one)
        torch.set_num_threads(max(2, threads))
        call(more)
    finally:
        torch.set_num_threads(threads)
