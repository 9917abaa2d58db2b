"""The ampfuse ops on DTensors (FSDP2's sharded params, grads and optimizer state).

Every list op of ampfuse but fused_lamb_ and fused_novograd_ is element-wise: element j of
tensor i of each list meets only element j of tensor i of the other lists. When tensor i of
every list is sharded alike (the same device mesh, placements and global shape), each rank
therefore runs the op on its local shards and gets exactly its shard of the unsharded result,
with no communication. That is what torch's own sharding strategy for its fused Adam
(list_pointwise_strategy) concludes for FSDP2 too; here it is a torch_dispatch rule for DTensor
(torch.library.register_torch_dispatch, public API), see docs/design/distributed.md for why not a
sharding strategy.

multi_tensor_l2norm is the one reduction: the local sums of squares become a DTensor whose
sharded mesh dimensions are Partial("sum"), and DTensor's own redistribution to Replicate
all-reduces them, so every rank gets the global norms. fused_lamb_ needs the same for each
param's trust ratio, and fused_novograd_ for each param's grad norm: each runs in two halves
with the per-tensor sums (or maxima) all-reduced between them.
multi_tensor_nonfinite_check_ checks the local shards and all-reduces its flag (MAX) over the
tensors' meshes, so every rank gets the same verdict; the per-tensor overflow flags
(tensor_flags) of the three flagging ops are OR-ed in the same collective, so every rank names
the same tensors.

Importing this module registers the rules; the wrappers of ampfuse.ops import it on their first
call after torch.distributed.tensor is loaded (no DTensor can exist before that), so they, the
optimizers and the scalers take DTensors without further setup. Code that calls
torch.ops.ampfuse.* directly on DTensors imports ampfuse.ops.dtensor first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from ampfuse.ops._checks import HELD_INF, HELD_NAN

# The element-wise ops; each mutates some of its lists in place and returns nothing.
POINTWISE_OPS = ("multi_tensor_unscale_", "multi_tensor_scale_", "multi_tensor_nonfinite_check_",
                 "fused_adam_", "fused_adam_coded_", "fused_sgd_", "fused_adagrad_")

# Lists with one tensor per param that are not sharded like it: fused_adam_coded_'s scales
# hold one absmax per block of 256 elements of the rank's local shard (each rank codes its own
# shard; the codes themselves are sharded like the param). They are plain tensors, or DTensors
# whose local tensor is the rank's own scales, and are passed on as those local tensors.
PER_RANK_LISTS = {"fused_adam_coded_": ("exp_avg_scales", "exp_avg_sq_scales",
                                        "max_exp_avg_sq_scales")}

# The ops that raise an overflow flag from what they read, and the list they read it from. A
# rank sees only its shards, so the flag is MAX-reduced over the mesh afterwards: every rank then
# skips the same steps, as with torch's GradScaler on DTensor grads (an inf in one rank's shard
# of a grad would otherwise make only that rank skip, and the ranks would drift apart).
FOUND_INF_READS = {"multi_tensor_unscale_": "grads", "multi_tensor_scale_": "src",
                   "multi_tensor_nonfinite_check_": "tensors"}

# A DTensor rule, as torch.library.register_torch_dispatch calls it:
# (cls, func, types, args, kwargs) -> what the op returns.
_Rule = Callable[..., Any]


def _is_tensor_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in value)


def _refuse_partial(op: str, what: str, t: DTensor) -> None:
    if any(p.is_partial() for p in t.placements):
        raise RuntimeError(
            f"ampfuse.{op}: {what} is a DTensor with placements {tuple(t.placements)}, i.e. it "
            "still holds a pending reduction (Partial); ampfuse ops read its values, so reduce "
            "it first, e.g. t.redistribute(placements=[Shard(0)]) or [Replicate()]."
        )


def _local_scalar(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """A one-element argument (step, lr, a scale or a flag): its local tensor, which must be the
    same value on every rank."""
    if not isinstance(t, DTensor):
        return t
    if not all(p.is_replicate() for p in t.placements):
        raise RuntimeError(
            f"ampfuse.{op}: {name} is a DTensor with placements {tuple(t.placements)}; a "
            "one-element argument must be a plain tensor or a Replicate() DTensor."
        )
    return t.to_local()


def _local_lists(op: str, names: Sequence[str],
                 lists: Sequence[Sequence[Any]]) -> list[list[torch.Tensor]]:
    """The lists with each DTensor replaced by its local shard, after checking that tensor i of
    every non-empty list is sharded like tensor i of the first one (otherwise their local shards
    would not line up element by element)."""
    leading = lists[0]
    for name, tensors in zip(names[1:], lists[1:]):
        for i, (t, ref) in enumerate(zip(tensors, leading)):
            if isinstance(t, DTensor) != isinstance(ref, DTensor):
                kinds = [
                    "a DTensor" if isinstance(x, DTensor) else "a plain tensor" for x in (t, ref)
                ]
                raise RuntimeError(
                    f"ampfuse.{op}: {name}[{i}] is {kinds[0]} but {names[0]}[{i}] is {kinds[1]}; "
                    "the tensors that go together (a param, its grad and its state) must all be "
                    "DTensors sharded alike, or all plain tensors."
                )
            if isinstance(t, DTensor) and (
                t.device_mesh != ref.device_mesh
                or t.placements != ref.placements
                or t.shape != ref.shape
            ):
                raise RuntimeError(
                    f"ampfuse.{op}: {name}[{i}] is sharded as {tuple(t.placements)} on "
                    f"{t.device_mesh} with shape {tuple(t.shape)}, but {names[0]}[{i}] as "
                    f"{tuple(ref.placements)} on {ref.device_mesh} with shape "
                    f"{tuple(ref.shape)}; they must be sharded alike (make the state with "
                    "torch.zeros_like(param) or redistribute the grad to the param's placements)."
                )
    out = []
    for name, tensors in zip(names, lists):
        local = []
        for i, t in enumerate(tensors):
            if isinstance(t, DTensor):
                _refuse_partial(op, f"{name}[{i}]", t)
                t = t.to_local()
            local.append(t)
        out.append(local)
    return out


def _own_local(op: str, what: str, t: torch.Tensor) -> torch.Tensor:
    """A per-rank tensor (see PER_RANK_LISTS): its local tensor as it is."""
    if not isinstance(t, DTensor):
        return t
    _refuse_partial(op, what, t)
    return t.to_local()


def _reduced_over_shards(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                         reduce_op: str) -> torch.Tensor:
    """`local` reduced with `reduce_op` ("sum", "max") over the ranks that hold different shards
    of a tensor placed as `placements`, by DTensor's own Partial -> Replicate redistribution;
    ranks along a Replicate dimension hold the same part and count once."""
    partial = [Partial(reduce_op) if p.is_shard() else Replicate() for p in placements]
    return DTensor.from_local(local, mesh, partial, run_check=False).full_tensor()


def _max_over_shards(flag: torch.Tensor, tensors: Sequence[torch.Tensor],
                     tensor_flags: torch.Tensor | None = None) -> None:
    """Sets the local one-element `flag` to its maximum over the ranks that hold different
    shards of `tensors`; ranks along a Replicate dimension saw the same values. With
    `tensor_flags` (the ops' per-tensor HELD_INF | HELD_NAN bits), the element of each sharded
    tensor is OR-ed over the ranks that hold its shards in the same collective, so every rank
    names the same tensors: as the MAX of each bit, since NCCL has no bitwise reduction."""
    # (mesh, placements) -> indices of the tensors sharded that way
    groups: dict[tuple[DeviceMesh, tuple[Placement, ...]], list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements):
            groups.setdefault((t.device_mesh, tuple(t.placements)), []).append(i)
    for (mesh, placements), indices in groups.items():
        if tensor_flags is None:
            flag.copy_(_reduced_over_shards(flag, mesh, placements, "max"))
            continue
        index = torch.tensor(indices, device=tensor_flags.device)
        local = tensor_flags[index]
        bits = [(local & bit).to(flag.dtype) for bit in (HELD_INF, HELD_NAN)]
        payload = torch.cat([flag.reshape(1), *bits])
        reduced = _reduced_over_shards(payload, mesh, placements, "max")
        flag.copy_(reduced[:1].reshape(flag.shape))
        count = len(indices)
        inf, nan = reduced[1:1 + count], reduced[1 + count:]
        tensor_flags[index] = inf.to(torch.int32) | nan.to(torch.int32)


def _pointwise_rule(op: str) -> _Rule:
    overload = getattr(torch.ops.ampfuse, op).default
    arg_names = [a.name for a in overload._schema.arguments]
    flag_source = FOUND_INF_READS.get(op)
    per_rank = PER_RANK_LISTS.get(op, ())

    def rule(cls: type, func: Callable[..., Any], types: tuple[type, ...],
             args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        bound = dict(zip(arg_names, args))
        bound.update(kwargs or {})
        flag_tensors = bound.get(flag_source, ()) if flag_source else ()  # still DTensors
        list_names = [n for n in arg_names
                      if n not in per_rank and _is_tensor_list(bound.get(n))]
        for name in per_rank:
            bound[name] = [_own_local(op, f"{name}[{i}]", t)
                           for i, t in enumerate(bound.get(name, ()))]
        if list_names:
            local = _local_lists(op, list_names, [bound[n] for n in list_names])
            bound.update(zip(list_names, local))
        for name, value in bound.items():
            if isinstance(value, torch.Tensor):
                bound[name] = _local_scalar(op, name, value)
        result = func(**bound)
        if flag_source is not None:
            _max_over_shards(bound["found_inf"], flag_tensors, bound.get("tensor_flags"))
        return result

    return rule


def _l2norm_rule(cls: type, func: Callable[..., Any], types: tuple[type, ...],
                 args: tuple[Any, ...] = (),
                 kwargs: Mapping[str, Any] | None = None) -> tuple[DTensor, DTensor]:
    """Global norms of DTensors: the local shards' squared norms, summed over the ranks that
    hold different shards by DTensor's own Partial -> Replicate redistribution."""
    op = "multi_tensor_l2norm"
    bound = dict(zip(("tensors", "per_tensor"), args))
    bound.update(kwargs or {})
    tensors, per_tensor = list(bound["tensors"]), bool(bound.get("per_tensor", False))
    mesh = None
    for i, t in enumerate(tensors):
        if not isinstance(t, DTensor):
            # RuntimeError, as every ampfuse op reports a tensor it cannot take.
            raise RuntimeError(  # noqa: TRY004
                f"ampfuse.{op}: tensors[{i}] is a plain tensor among DTensors; its norm could "
                "be local or global. Pass only DTensors (e.g. DTensor.from_local(t, mesh, "
                "[Replicate()]) for a replicated tensor) or norm the plain ones separately."
            )
        _refuse_partial(op, f"tensors[{i}]", t)
        mesh = mesh or t.device_mesh
        if t.device_mesh != mesh:
            raise RuntimeError(
                f"ampfuse.{op}: tensors[{i}] is on {t.device_mesh} but tensors[0] on {mesh}; "
                "take the norm of each device mesh's tensors in a separate call."
            )
    # DTensor dispatches here only with a DTensor among the tensors, so there is a mesh.
    assert mesh is not None
    _, local_norms = func([t.to_local() for t in tensors], True)
    # float64 so that squaring a large fp32 norm cannot overflow before the sqrt.
    squares = local_norms.double().square()
    # placements -> indices of the tensors sharded that way
    groups: dict[tuple[Placement, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(tuple(t.placements), []).append(i)
    total = torch.empty_like(squares)
    for placements, indices in groups.items():
        index = torch.tensor(indices, device=squares.device)
        total[index] = _reduced_over_shards(squares[index], mesh, placements, "sum")
    per_tensor_norms = total.sqrt().float()
    global_norm = total.sum().sqrt().float()
    if not per_tensor:
        per_tensor_norms = per_tensor_norms.new_empty((0,))
    replicate = [Replicate()] * mesh.ndim
    return (
        DTensor.from_local(global_norm, mesh, replicate, run_check=False),
        DTensor.from_local(per_tensor_norms, mesh, replicate, run_check=False),
    )


def _two_pass_rule(op: str, buffer: str, first_part: str, columns: int | None,
                   reduce_op: Callable[[dict[str, Any]], str],
                   per_param_scalars: tuple[str, ...] = ()) -> _Rule:
    """The DTensor rule of an optimizer op that is element-wise except for a reduction of each
    whole param (fused_lamb_'s trust ratios, fused_novograd_'s grad norms). The first pass
    (part=first_part) runs on the local shards and leaves each tensor's local reduction in
    `buffer` (float64, `columns` per tensor, or one when None); those are combined over the
    ranks that hold different shards (DTensor's Partial -> Replicate, as for
    multi_tensor_l2norm) by reduce_op(bound args), "sum" or "max"; and the second pass
    (part="apply") runs on the local shards from the combined values. Every rank so gets what
    a single process would. `per_param_scalars` name lists of one element per param (running
    norms), which every rank holds whole: plain tensors or Replicate() DTensors."""
    arg_names = [a.name for a in getattr(torch.ops.ampfuse, op).default._schema.arguments]

    def rule(cls: type, func: Callable[..., Any], types: tuple[type, ...],
             args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> None:
        bound = dict(zip(arg_names, args))
        bound.update(kwargs or {})
        if bound.get("part", "both") != "both" or bound.get(buffer) is not None:
            raise RuntimeError(
                f"ampfuse.{op}: part and {buffer} are how the DTensor rule splits a sharded "
                f"step; call it on DTensors with part='both' and no {buffer}."
            )
        params = list(bound["params"])
        list_names = [n for n in arg_names
                      if n not in per_param_scalars and _is_tensor_list(bound.get(n))]
        local = _local_lists(op, list_names, [bound[n] for n in list_names])
        bound.update(zip(list_names, local))
        for name in per_param_scalars:
            bound[name] = [_local_scalar(op, f"{name}[{i}]", t)
                           for i, t in enumerate(bound[name])]
        for name, value in bound.items():
            if isinstance(value, torch.Tensor):
                bound[name] = _local_scalar(op, name, value)
        shape = (len(params),) if columns is None else (len(params), columns)
        values = torch.zeros(shape, dtype=torch.float64, device=bound["step"].device)
        func(**dict(bound, **{buffer: values, "part": first_part}))
        combine_over_shards(values, params, reduce_op(bound))
        func(**dict(bound, **{buffer: values, "part": "apply"}))

    return rule


def combine_over_shards(values: torch.Tensor, params: Sequence[Any], reduce_op: str) -> None:
    """Row i of `values` (a local reduction of param i's shard) combined in place over the
    ranks that hold different shards of params[i] ("sum" or "max"), as a single process would
    have it; rows of plain or replicated params stay. What the two-pass rules run between
    their halves, and what FusedLAMB runs between the halves of fused_lamb_coded_."""
    # (mesh, placements) -> indices of the params sharded that way
    groups: dict[tuple[DeviceMesh, tuple[Placement, ...]], list[int]] = {}
    for i, t in enumerate(params):
        if isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements):
            groups.setdefault((t.device_mesh, tuple(t.placements)), []).append(i)
    for (mesh, placements), indices in groups.items():
        index = torch.tensor(indices, device=values.device)
        values[index] = _reduced_over_shards(values[index], mesh, placements, reduce_op)


def _refuse_lamb_coded(cls: type, func: Callable[..., Any], types: tuple[type, ...],
                       args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> None:
    # The scales of sharded codes are padded to the largest shard's blocks
    # (optimizers._state_codes_sharded), which only the optimizer knows how to cut.
    raise RuntimeError(
        "ampfuse.fused_lamb_coded_ takes no DTensors: call it on each rank's local shards "
        "(codes and their own scales) with part='moments', add tensor_sums over the shards "
        "(ampfuse.ops.dtensor.combine_over_shards), then part='apply'; FusedLAMB does."
    )


# LAMB: each param's sums of squares of itself and of its update, added over the shards.
_lamb_rule = _two_pass_rule("fused_lamb_", "tensor_sums", "moments", 2, lambda bound: "sum")
# NovoGrad: each param's sum of squares (L2) or max |g| (norm_type 0) of its grads.
_novograd_rule = _two_pass_rule(
    "fused_novograd_", "tensor_reductions", "norms", None,
    lambda bound: "max" if bound["norm_type"] == 0 else "sum", per_param_scalars=("norm_avgs",))


for _op in POINTWISE_OPS:
    torch.library.register_torch_dispatch(f"ampfuse::{_op}", DTensor, _pointwise_rule(_op))
torch.library.register_torch_dispatch("ampfuse::multi_tensor_l2norm", DTensor, _l2norm_rule)
torch.library.register_torch_dispatch("ampfuse::fused_lamb_", DTensor, _lamb_rule)
torch.library.register_torch_dispatch("ampfuse::fused_lamb_coded_", DTensor,
                                      _refuse_lamb_coded)
torch.library.register_torch_dispatch("ampfuse::fused_novograd_", DTensor, _novograd_rule)
