"""Arguments for fused_adam_coded_ and its plain reference: dequantize_moment -> fused_adam_ on
fp32 moments -> quantize_moment (python/ampfuse/optimizers/_state_codes.py), which the op must
match bit for bit. Shared by test_adam_coded.py and test_adam_coded_errors.py."""

import ampfuse  # noqa: F401  (loads the ops)
import torch
from ampfuse.optimizers._state_codes import dequantize_moment, quantize_moment

CODE_DTYPES = {"int8": (torch.int8, torch.uint8),
               "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fn)}
MOMENTS = (("exp_avg", False), ("exp_avg_sq", True), ("max_exp_avg_sq", True))
# Short last blocks (1000, 3 * 300) and a param of exactly one block.
SHAPES = [(1000,), (3, 300), (256,)]
HYPER = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def memory_flat(t):
    """t's elements in memory order, as a flat view (t dense)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).reshape(-1)


def _laid_out_like(flat, param, dtype):
    out = torch.empty_like(param, dtype=dtype)
    memory_flat(out).copy_(flat)
    return out


def make_case(kind, param_dtype=torch.float32, master_mode="fp32", masters=True, amsgrad=False,
              shapes=SHAPES, channels_last=False, seed=0, device="cpu", grad_scale=None):
    """Params, grads, coded moments (from random fp32 moments), masters and scalars."""
    gen = torch.Generator().manual_seed(seed)

    def rand(shape, scale=1.0, positive=False):
        x = torch.rand(shape, generator=gen) if positive else torch.randn(shape, generator=gen)
        return x * scale

    params, grads = [], []
    for i, shape in enumerate(shapes):
        p = rand(shape).to(param_dtype)
        if channels_last:
            p = p.contiguous(memory_format=torch.channels_last)
        grad_dtype = (torch.float32, param_dtype)[i % 2]
        g = torch.empty_like(p, dtype=grad_dtype).copy_(rand(shape) * (grad_scale or 1.0))
        params.append(p)
        grads.append(g)
    case = {"kind": kind, "params": params, "grads": grads, "amsgrad": amsgrad,
            "master_mode": master_mode}
    for key, second in MOMENTS:
        codes, scales = [], []
        if key != "max_exp_avg_sq" or amsgrad:
            for p in params:
                moment = rand(p.shape, 1e-3, positive=True) if second else rand(p.shape, 1e-2)
                if second and key == "max_exp_avg_sq":
                    moment = moment * 2
                c, s = quantize_moment(memory_flat(moment.contiguous(
                    memory_format=torch.channels_last) if channels_last else moment), kind,
                    second)
                codes.append(_laid_out_like(c, p, c.dtype))
                scales.append(s)
        case[f"{key}_codes"], case[f"{key}_scales"] = codes, scales
    if master_mode == "fp32":
        extra = [(p.float() + rand(p.shape, 1e-3)).contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format)
            for p in params] if masters else []
    elif master_mode == "kahan":
        extra = [torch.empty_like(p).copy_(rand(p.shape, 2**-10)) for p in params]
    elif master_mode == "split":
        extra = [torch.empty_like(p, dtype=torch.int16).copy_(
            torch.randint(-2**15, 2**15, p.shape, generator=gen, dtype=torch.int16))
            for p in params]
    else:
        extra = []
    case["master_params"] = extra
    case["param_ids"] = [7 + i for i in range(len(params))] if master_mode == "stochastic" else []
    case["step"] = torch.full((1,), 3.0)
    case["lr"] = torch.full((1,), 1e-3)
    case["grad_scale"] = None if grad_scale is None else torch.full((1,), float(grad_scale))
    case["found_inf"] = None
    return {k: _to(v, device) for k, v in case.items()}


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [t.to(device) for t in value]
    return value


def clone_case(case):
    def clone(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            return [t.clone() for t in v]
        return v
    return {k: clone(v) for k, v in case.items()}


def op_args(case, adam_w_mode=True, maximize=False, write_unscaled_grads=True, seed=5):
    """(args, kwargs) of torch.ops.ampfuse.fused_adam_coded_ for the case."""
    args = (case["params"], case["grads"], case["exp_avg_codes"], case["exp_avg_scales"],
            case["exp_avg_sq_codes"], case["exp_avg_sq_scales"], case["max_exp_avg_sq_codes"],
            case["max_exp_avg_sq_scales"], case["master_params"], case["step"], case["lr"],
            HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], adam_w_mode,
            True, case["amsgrad"], maximize, case["grad_scale"], case["found_inf"])
    kwargs = {"write_unscaled_grads": write_unscaled_grads, "state_dtype": case["kind"],
              "master_mode": case["master_mode"], "param_ids": case["param_ids"], "seed": seed}
    return args, kwargs


def coded_step(case, **options):
    """One step of the op, in place on the case."""
    args, kwargs = op_args(case, **options)
    torch.ops.ampfuse.fused_adam_coded_(*args, **kwargs)


def reference_step(case, adam_w_mode=True, maximize=False, write_unscaled_grads=True, seed=5):
    """One step of the reference, in place on the case: each coded moment decoded into an fp32
    tensor laid out like its param, fused_adam_, and the new moments coded again."""
    kind, params = case["kind"], case["params"]
    moments = {}
    for key, second in MOMENTS:
        moments[key] = []
        for p, c, s in zip(params, case[f"{key}_codes"], case[f"{key}_scales"]):
            flat = dequantize_moment(memory_flat(c), s, kind, second)
            moments[key].append(_laid_out_like(flat, p, torch.float32))
    torch.ops.ampfuse.fused_adam_(
        params, case["grads"], moments["exp_avg"], moments["exp_avg_sq"],
        moments["max_exp_avg_sq"], case["master_params"], case["step"], case["lr"],
        HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], adam_w_mode, True,
        case["amsgrad"], maximize, case["grad_scale"], case["found_inf"], write_unscaled_grads,
        case["master_mode"], case["param_ids"], seed)
    if case["found_inf"] is not None and case["found_inf"].item() != 0:
        return
    for key, second in MOMENTS:
        for i, m in enumerate(moments[key]):
            codes, scales = quantize_moment(memory_flat(m), kind, second)
            memory_flat(case[f"{key}_codes"][i]).copy_(codes)
            case[f"{key}_scales"][i].copy_(scales)


TENSOR_KEYS = ("params", "grads", "exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes",
               "exp_avg_sq_scales", "max_exp_avg_sq_codes", "max_exp_avg_sq_scales",
               "master_params")


def _bits(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype.is_floating_point:
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(width), torch.isnan(t.float()) if t.element_size() > 1 else None
    return t, None


def assert_same_bits(actual, expected):
    """Every tensor of the two cases equal bit for bit (a nan equals any nan: the nan a block
    carries is not part of the contract), with the worst mismatch named."""
    for key in TENSOR_KEYS + ("step",):
        a_list, e_list = actual[key], expected[key]
        if isinstance(a_list, torch.Tensor):
            a_list, e_list = [a_list], [e_list]
        assert len(a_list) == len(e_list), key
        for i, (a, e) in enumerate(zip(a_list, e_list)):
            assert a.shape == e.shape and a.stride() == e.stride(), f"{key}[{i}] layout"
            (ab, an), (eb, en) = _bits(a), _bits(e)
            if an is not None:
                assert torch.equal(an, en), f"{key}[{i}]: nan at different elements"
                ab, eb = ab[~an], eb[~en]
            differ = (ab != eb).nonzero()
            assert differ.numel() == 0, (
                f"{key}[{i}]: {differ.shape[0]} of {ab.numel()} elements differ, the first "
                f"(of the non-nan ones, in logical order) at {differ[0].item()}: bits "
                f"{ab[differ[0]].item()} vs {eb[differ[0]].item()}")
