"""What FusedAdam and FusedSGD share: grouping parameters into op calls, the shared step count,
fp32 master weights, device-side learning rates, the GradScaler protocol, and a state_dict in
torch.optim's layout.

How a step is laid out
----------------------
The fused ops update whole lists of tensors in one launch and take ONE step counter for the list.
Every parameter's state therefore holds a reference to a step tensor (a 0-dim float32 tensor on
the parameter's device) that it shares with the other parameters of its group and device: the
params sharing one step tensor form one op call. Params with and without an fp32 master never
share one (the op takes masters for all of its params or for none), so a group with master
weights and mixed dtypes makes two calls per device.

torch.optim counts steps per parameter, and a parameter whose grad is None skips the step
without counting it. To keep that meaning, a step tensor shared with a parameter that has no
grad this time is cloned (on the device) for the parameters that do step, and params whose state
is created later start a step tensor of their own at zero. Params that always step together,
the usual case, keep sharing one counter forever.

Nothing on this path reads a device value back to the host. Whether the step is skipped
(found_inf from a loss scaler, skip_nonfinite's check of the grads) is decided on the device
for the whole step before any op call updates a param (see _skip).
"""

from __future__ import annotations

import collections
import copy
import numbers

import torch

from ampfuse.optimizers._masters import param_mark, refresh_master
from ampfuse.optimizers._skip import SkipRecord, check_skip_nonfinite, on_device, step_verdicts

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def param_name(group_index, param_index):
    return f"param_groups[{group_index}]['params'][{param_index}]"


def fp32_like(p):
    """Zeros in fp32 with p's shape, device and (dense) strides."""
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)


def same_layout(t, p):
    """Whether state tensor `t` walks memory in the same order as param `p`, the rule the fused
    ops apply to the tensors they write (one element or none has no order)."""
    return t.numel() <= 1 or t.stride() == p.stride()


def fp32_copy(value, p):
    """A loaded state tensor as fp32 on p's device, laid out like p (a checkpoint saved from
    contiguous params loads into a channels_last model). A tensor that already is fp32, on p's
    device and in p's layout, is used as it is, as torch.optim does."""
    if value.dtype == torch.float32 and value.device == p.device and same_layout(value, p):
        return value
    out = torch.empty_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    return out.copy_(value)


class _Call:
    """The tensors of one op call: params sharing one step tensor and master-ness."""

    __slots__ = ("step", "has_master", "params", "grads", "states")

    def __init__(self, step, has_master):
        self.step = step
        self.has_master = has_master
        self.params, self.grads, self.states = [], [], []

    def masters(self):
        return [s["master_param"] for s in self.states] if self.has_master else []


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of the ampfuse optimizers; subclasses supply the per-family parts:

    _check_hyperparameters(index, group); _prepare_state(group, p, state), which creates what a
    param's state lacks; _launch(group, call, lr, grad_scale, found_inf); _export_state(group,
    state, step_value) -> the torch-layout dict; _import_state(group, p, saved, where) -> (state,
    step value or None); _import_group(saved, current, new); and the class attributes below.
    """

    # torch.amp.GradScaler leaves unscaling to step() and hands over `grad_scale` and `found_inf`.
    _step_supports_amp_scaling = True
    # Set by ampfuse.amp for one step after it unscaled grads onto the fp32 masters.
    _step_on_master_grads = False
    # Keys that torch.optim's counterpart keeps in its param groups but that mean nothing here:
    # written into state_dict() (so torch can load it) and dropped by load_state_dict().
    _TORCH_GROUP_KEYS: dict = {}
    # Hyperparameters of the other optimizer family: a group holding one is a mistake.
    _FOREIGN_GROUP_KEYS: tuple = ()

    def __init__(self, params, defaults, set_grad_none=True):
        self.set_grad_none = set_grad_none
        # (group index, device) -> [last lr value, 0-dim fp32 lr tensor on that device]
        self._lr_tensors = {}
        # param -> its strides when its state was last checked to share its layout (see
        # _match_layout); not part of the state, so state_dict() keeps torch's layout.
        self._layouts = {}
        # param with a master -> param_mark(param) right after the last step wrote it; a
        # different mark at the next step means someone else wrote the param (see _masters).
        self._master_marks = {}
        # last_step_skipped and the skipped-step count (see _skip).
        self._skips = SkipRecord()
        super().__init__(params, defaults)

    def __getstate__(self):
        state = super().__getstate__()
        state["set_grad_none"] = self.set_grad_none
        state["skipped_steps"] = self.get_skipped_steps()
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        # torch.optim adds this default on unpickling; no fused optimizer is differentiable.
        self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("set_grad_none", True)
        self.__dict__.setdefault("_lr_tensors", {})
        self.__dict__.setdefault("_layouts", {})
        self.__dict__.setdefault("_master_marks", {})
        skipped = self.__dict__.pop("skipped_steps", 0)
        self.__dict__.setdefault("_skips", SkipRecord(skipped))
        # Pickled before the option existed: such optimizers never checked.
        self.defaults.setdefault("skip_nonfinite", False)
        for group in self.param_groups:
            group.setdefault("skip_nonfinite", False)

    # ---- param groups and validation ----------------------------------------------------------

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._check_group(index, self.param_groups[index])
        except Exception:
            self.param_groups.pop()
            raise

    def _check_group(self, index, group):
        name = type(self).__name__
        for key in self._FOREIGN_GROUP_KEYS:
            if key in group:
                raise ValueError(
                    f"{name}: param_groups[{index}] sets {key!r}, which {name} does not have; "
                    f"remove it from the group (it belongs to another optimizer)."
                )
        for i, p in enumerate(group["params"]):
            self._check_param_dtype(index, i, p)
        self._check_hyperparameters(index, group)
        check_skip_nonfinite(self, index, group)

    def _check_param_dtype(self, group_index, param_index, p):
        if p.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{type(self).__name__}: {param_name(group_index, param_index)} has dtype "
                f"{p.dtype}; fused optimizers update torch.float32, torch.float16 and "
                "torch.bfloat16 parameters only (no complex, integer or float64 ones)."
            )

    def _check_lr(self, index, lr):
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1 or not lr.is_floating_point():
                raise ValueError(
                    f"{type(self).__name__}: param_groups[{index}]['lr'] is a tensor of shape "
                    f"{tuple(lr.shape)} and dtype {lr.dtype}; a tensor lr must be one "
                    "floating-point element."
                )
            return
        if not lr >= 0.0:
            raise ValueError(
                f"{type(self).__name__}: param_groups[{index}] has lr={lr}; the learning rate "
                "must be >= 0."
            )

    def _check_nonnegative(self, index, group, key):
        if not group[key] >= 0.0:
            raise ValueError(
                f"{type(self).__name__}: param_groups[{index}] has {key}={group[key]}; it must "
                "be >= 0."
            )

    # ---- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One optimization step of every param that has a grad.

        grad_scale: the loss scale the grads carry; they are divided by it inside the op.
        found_inf: a nonzero value skips the step entirely: no param, master, moment or step
        count is written. Both are one-element tensors (a float is accepted for grad_scale),
        read on the device. When they are not given, the `grad_scale` and `found_inf`
        attributes that torch.amp.GradScaler sets on the optimizer during its step() are used.
        A step with no found_inf checks the grads itself where skip_nonfinite says so.
        """
        self._check_capture()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        plans = []
        for index, group in enumerate(self.param_groups):
            self._check_hyperparameters(index, group)
            check_skip_nonfinite(self, index, group)
            plans.append((index, group, self._calls(index, group)))
        # Every check before any update: one verdict for the whole step.
        verdicts = step_verdicts(plans, found_inf)
        home = self._first_device()
        self._skips.prepare(verdicts, home, self._capturing(), type(self).__name__)
        scales = {}
        for index, group, calls in plans:
            for call in calls:
                device = call.step.device
                self._launch(
                    group,
                    call,
                    self._lr_tensor(index, group, device),
                    on_device(grad_scale, device, scales, "grad_scale"),
                    verdicts.get(device),
                )
                if call.has_master and not torch.compiler.is_compiling():
                    self.mark_masters(call.params)
        self._skips.record(verdicts, home)
        return loss

    @property
    def last_step_skipped(self):
        """Whether the last step() was skipped, by skip_nonfinite's check or by a found_inf
        from a loss scaler: a 0-dim bool tensor on the params' device (reading its value
        syncs). A step that could be skipped gets a new tensor; one that nothing could skip (no
        check, no found_inf) reports False. None before the first step and after
        load_state_dict()."""
        return self._skips.last

    def get_skipped_steps(self):
        """How many steps were skipped so far, by skip_nonfinite or by a found_inf from a loss
        scaler (torch.amp.GradScaler, ampfuse.GradScaler, amp). Counted on the device; reading
        it syncs. state_dict() saves it as 'skipped_steps' and load_state_dict() restores it."""
        return self._skips.count()

    def _first_device(self):
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def _follow(self, p, master):
        """Remakes `master` if something other than a step wrote `p` since it was marked."""
        mark = self._master_marks.get(p)
        if mark is not None and mark != param_mark(p):
            refresh_master(master, p)
            self._master_marks[p] = param_mark(p)

    def follow_masters(self):
        """What each step does for the params it updates, for every param with a master now
        (before its masters are saved, say)."""
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state.get(p, {}).get("master_param")
                if master is not None:
                    self._follow(p, master)

    def mark_masters(self, params):
        """Records that `params` now hold what their masters say (the step just wrote them, or
        a caller such as amp set the masters from them): until something else writes one of
        them, its master is not looked at again."""
        marks = self._master_marks
        for p in params:
            marks[p] = param_mark(p)

    def _calls(self, index, group):
        """Sorts the params of `group` that have grads into op calls (see the module docstring),
        creating state on a param's first step.

        This runs for every param at every step, so it stays lean: torch already guarantees that
        a grad has its param's dtype, shape and device. Step tensors are told apart with `is`
        and plain lists, not id() and dicts, so that torch.compile traces step() whole."""
        calls = []
        idle_steps = []  # step tensors of params that have no grad this time
        new_steps = {}  # (device, has_master) -> the step tensor of params starting now
        all_state = self.state
        master_weights = bool(group["master_weights"])
        # Host-side bookkeeping that torch.compile cannot trace; compiled steps skip it.
        follow_params = not torch.compiler.is_compiling()
        call = None
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                state = all_state.get(p)
                if state and "step" in state:
                    idle_steps.append(state["step"])
                continue
            if grad.layout != torch.strided or p.dtype not in _FLOAT_DTYPES:
                self._reject(index, i, p, grad)
            has_master = master_weights and p.dtype in _LOW_PRECISION
            state = all_state[p]
            if "step" not in state or self._starts_over(group, state):
                self._check_not_capturing(index, i)
                key = (p.device, has_master)
                if key not in new_steps:
                    new_steps[key] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["step"] = new_steps[key]
            self._prepare_state(group, p, state)
            if has_master:
                if "master_param" not in state:
                    self._check_not_capturing(index, i)
                    state["master_param"] = p.detach().to(torch.float32, copy=True)
                elif follow_params:
                    self._follow(p, state["master_param"])
                # amp may have put unscaled fp32 grads on the masters (apex's clipping recipe);
                # they then take the place of the params' low-precision ones for this step.
                if self._step_on_master_grads and state["master_param"].grad is not None:
                    grad = state["master_param"].grad
            elif "master_param" in state:
                del state["master_param"]
            if self._layouts.get(p) != p.stride():
                self._match_layout(index, i, p, state)
            step = state["step"]
            if call is None or call.step is not step or call.has_master != has_master:
                call = None
                for candidate in calls:
                    if candidate.step is step and candidate.has_master == has_master:
                        call = candidate
                        break
                if call is None:
                    call = _Call(step, has_master)
                    calls.append(call)
            call.params.append(p)
            call.grads.append(grad)
            call.states.append(state)
        # A step tensor must advance once per step, for exactly the params that stepped.
        launched = []
        for call in calls:
            shared = call.step
            if _holds(idle_steps, shared) or _holds(launched, shared):
                call.step = shared.clone()
                for state in call.states:
                    state["step"] = call.step
            launched.append(shared)
        return calls

    def _match_layout(self, group_index, param_index, p, state):
        """Lays p's state tensors out like p when p's layout changed since they were made, e.g.
        by model.to(memory_format=torch.channels_last) after some steps: the fused ops walk a
        param and its state flat, so both must share one element order. Runs when p's strides
        differ from those recorded at the last check (one stride comparison per param and
        step otherwise). The tensors are changed in place (same objects, same values), so
        references held elsewhere, such as amp's list of masters, stay valid."""
        strides = p.stride()
        for value in state.values():
            if (
                isinstance(value, torch.Tensor)
                and value.shape == p.shape
                and not same_layout(value, p)
            ):
                if self._capturing():
                    raise RuntimeError(
                        f"{type(self).__name__}: {param_name(group_index, param_index)} changed "
                        "its memory layout (e.g. model.to(memory_format=...)) since its optimizer "
                        "state was made, and the state cannot be re-laid out during CUDA graph "
                        "capture; run one step eagerly after changing the layout, then capture."
                    )
                value.set_(torch.empty_like(p, dtype=value.dtype).copy_(value))
        self._layouts[p] = strides

    def _starts_over(self, group, state):
        """True when a param's existing state must count steps from zero again."""
        return False

    def _import_group(self, saved, current, new):
        """Adjusts a loaded group `new` (saved keys minus torch-only ones) before the current
        group's missing keys are filled in."""

    def _reject(self, group_index, param_index, p, grad):
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"{type(self).__name__}: {param_name(group_index, param_index)} has a "
                f"{grad.layout} gradient; fused optimizers take dense gradients only "
                "(torch.optim.SparseAdam handles sparse ones)."
            )
        self._check_param_dtype(group_index, param_index, p)

    def _lr_tensor(self, index, group, device):
        """group['lr'] as a 0-dim fp32 tensor on `device`. A float lr lives in a tensor kept per
        group and device and refilled (a device-side fill, no copy from the host) when it
        changes, so LR schedulers work; a tensor lr on the device is used as it is."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            if lr.device == device and lr.dtype == torch.float32:
                return lr
            return lr.to(device=device, dtype=torch.float32, non_blocking=True)
        key = (index, device)
        entry = self._lr_tensors.get(key)
        if entry is None:
            value = torch.full((), lr, dtype=torch.float32, device=device)
            entry = self._lr_tensors[key] = [lr, value]
        elif entry[0] != lr:
            entry[1].fill_(lr)
            entry[0] = lr
        return entry[1]

    # ---- CUDA graphs --------------------------------------------------------------------------

    def _capturing(self):
        if torch.compiler.is_compiling() or not torch.cuda.is_available():
            return False
        return torch.cuda.is_current_stream_capturing()

    def _check_capture(self):
        if self._capturing() and not all(g.get("capturable", True) for g in self.param_groups):
            raise RuntimeError(
                f"{type(self).__name__}: step() is being captured in a CUDA graph but "
                "capturable=False; construct the optimizer with capturable=True."
            )

    def _check_not_capturing(self, group_index, param_index):
        if self._capturing():
            raise RuntimeError(
                f"{type(self).__name__}: {param_name(group_index, param_index)} has no optimizer "
                "state yet and state cannot be created during CUDA graph capture; run at least "
                "one step eagerly (with every param that will have a grad) before capturing."
            )

    # ---- gradients and masters ----------------------------------------------------------------

    def zero_grad(self, set_to_none=None):
        """Resets every grad: to None when set_to_none (default: the optimizer's set_grad_none),
        else to zeros."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def master_params(self):
        """The tensors the optimizer actually updates, one per param in param-group order: the
        fp32 master of each fp16/bf16 param of a group with master_weights (created now from the
        param if no step has created it yet), else the param itself."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if group["master_weights"] and p.dtype in _LOW_PRECISION:
                    state = self.state[p]
                    if "master_param" not in state:
                        state["master_param"] = p.detach().to(torch.float32, copy=True)
                    out.append(state["master_param"])
                else:
                    out.append(p)
        return out

    # ---- state_dict in torch.optim's layout ---------------------------------------------------

    @torch._disable_dynamo
    def state_dict(self):
        """The state in torch.optim's layout, loadable by torch.optim's counterpart.

        Each param's 'step' is its own float32 0-dim tensor (on the CPU, or on the param's device
        for capturable groups), as torch.optim keeps it; moments stay fp32 whatever the param's
        dtype, and 'master_param' (fp32) is included so a resumed run continues from the exact
        masters. Param groups carry torch's keys (e.g. 'decoupled_weight_decay', 'foreach',
        'fused') besides ours. State tensors other than 'step' are the live ones, as in torch.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        index_of, packed_groups = {}, []
        group_of = {}
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for key, value in self._TORCH_GROUP_KEYS.items():
                packed[key] = value(group) if callable(value) else value
            ids = []
            for p in group["params"]:
                if id(p) not in index_of:
                    index_of[id(p)] = len(index_of)
                ids.append(index_of[id(p)])
                group_of[id(p)] = group
            packed["params"] = ids
            packed_groups.append(packed)
        step_values = {}  # id(step tensor) -> its value, read once per tensor
        packed_state = {}
        for key, state in self.state.items():
            if not isinstance(key, torch.Tensor):
                packed_state[key] = state
                continue
            if id(key) not in index_of:
                continue  # a tensor no group holds any more has no index to be saved under
            group = group_of[id(key)]
            step = state.get("step")
            step_value = None
            if step is not None:
                if id(step) not in step_values:
                    where = step.device if group.get("capturable", False) else "cpu"
                    step_values[id(step)] = step.detach().to(where, torch.float32, copy=True)
                step_value = step_values[id(step)].clone()
            exported = self._export_state(group, state, step_value)
            if exported:
                packed_state[index_of[id(key)]] = exported
        state_dict = {
            "state": packed_state,
            "param_groups": packed_groups,
            "skipped_steps": self.get_skipped_steps(),
        }
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @torch._disable_dynamo
    def load_state_dict(self, state_dict):
        """Loads a state_dict of this optimizer or of torch.optim's counterpart.

        Unlike torch.optim, which casts state to each param's dtype, moments and masters are
        kept (or made) fp32. Params whose saved step counts are equal share one step tensor
        again; unequal counts simply make more op calls. Hyperparameters come from the saved
        groups; keys of ours that a torch checkpoint lacks keep their current values.
        """
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        skipped_steps = state_dict.get("skipped_steps")
        if skipped_steps is None:  # a torch or older checkpoint: the count goes on from its value
            skipped_steps = self.get_skipped_steps()
        elif isinstance(skipped_steps, bool) or not (
            isinstance(skipped_steps, numbers.Integral) and skipped_steps >= 0
        ):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: skipped_steps must be an int >= 0, got "
                f"{skipped_steps!r}."
            )
        skipped_steps = int(skipped_steps)
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state dict has {len(saved_groups)} "
                f"param groups but the optimizer has {len(groups)}."
            )
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: param_groups[{index}] has "
                    f"{len(saved['params'])} params in the state dict but "
                    f"{len(group['params'])} in the optimizer."
                )
        new_groups = []
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            new_group = {k: v for k, v in saved.items() if k not in self._TORCH_GROUP_KEYS}
            self._import_group(saved, group, new_group)
            for key, value in group.items():
                new_group.setdefault(key, value)
            new_group["params"] = group["params"]
            self._check_group(index, new_group)  # before anything of the optimizer changes
            new_groups.append(new_group)

        saved_state = state_dict["state"]
        state = collections.defaultdict(dict)
        param_ids = set()
        for group_index, (group, saved) in enumerate(zip(new_groups, saved_groups)):
            shared_steps = {}  # (device, has_master, value) -> one step tensor
            for param_index, (index_in_dict, p) in enumerate(zip(saved["params"], group["params"])):
                param_ids.add(index_in_dict)
                if index_in_dict not in saved_state:
                    continue
                imported, step_value = self._import_state(
                    group, p, saved_state[index_in_dict], param_name(group_index, param_index)
                )
                if step_value is not None:
                    has_master = bool(group["master_weights"]) and p.dtype in _LOW_PRECISION
                    key = (p.device, has_master, step_value)
                    if key not in shared_steps:
                        shared_steps[key] = torch.full(
                            (), step_value, dtype=torch.float32, device=p.device
                        )
                    imported["step"] = shared_steps[key]
                if imported:
                    state[p] = imported
        for key, value in saved_state.items():
            if key not in param_ids:
                state[key] = value  # state not tied to a param is kept as it is, as torch does

        self.__setstate__({"state": state, "param_groups": new_groups})
        self._lr_tensors = {}
        self._layouts = {}
        self._skips = SkipRecord(skipped_steps)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _import_master(self, group, p, saved, imported, where):
        """Takes a saved master over for a param that keeps one; where the group keeps no
        master for the param (master_weights off, or an fp32 param), the param's value rules and
        the saved master is dropped."""
        master = saved.get("master_param")
        if master is None or not (group["master_weights"] and p.dtype in _LOW_PRECISION):
            return
        self._check_saved_shape(where, "master_param", master, p)
        imported["master_param"] = fp32_copy(master, p)

    def _check_saved_shape(self, where, key, value, p):
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state of {where} has {key!r} of shape "
                f"{tuple(value.shape)} but the param has shape {tuple(p.shape)}; the state dict "
                "belongs to another model."
            )


def _holds(tensors, t):
    for candidate in tensors:
        if candidate is t:
            return True
    return False

