"""AmpHandle: everything amp.initialize sets up for one set of models and optimizers.

The handle owns the loss scalers (one per loss), the hooks it installed, and one Binding per
optimizer (binding.py: how that optimizer's gradients are unscaled and how an overflowing step
is skipped). It is attached to its models and optimizers (attribute `_ampfuse_amp`), which is
how amp.scale_loss and the other module-level functions find it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, cast

import torch

from ampfuse.amp import checkpoint
from ampfuse.amp.attribution import StepAttribution
from ampfuse.amp.binding import Binding
from ampfuse.amp.ddp_watch import NoSyncWatch
from ampfuse.amp.masters import LoadCapture
from ampfuse.amp.optimizer_access import grads_of, optimizer_params
from ampfuse.amp.reporting import OverflowReporter
from ampfuse.optimizers import FusedOptimizer
from ampfuse.overflow import OverflowReport, ParamNames
from ampfuse.scaling.loss_scaler import LossScaler

log = logging.getLogger("ampfuse.amp")


class _Hook(Protocol):
    """What amp keeps in handle.hooks: anything it can take off again (torch's hook handles,
    amp's own watches and wrappers)."""

    def remove(self) -> None: ...


def _overflow_counted_this_step(bindings: Sequence[Binding]) -> torch.Tensor | None:
    """A device flag set when every optimizer of a scale_loss call is a fused one whose
    accumulated grads already overflowed earlier in this optimizer step, else None.

    Fused optimizers keep the grads scaled and accumulating until their step ("fold"), so an
    inf from an earlier micro-batch is seen again by every later check of the same step. It was
    counted (the scale backed off) when it appeared; counting it again would back off twice,
    and under DDP's no_sync, where only the rank that overflowed sees the first inf, on that
    rank only, so the ranks' scales would drift apart."""
    if not bindings or any(b.kind != "fold" or b.window_inf is None for b in bindings):
        return None
    windows = [b.window_inf for b in bindings if b.window_inf is not None]  # all of them
    device = windows[0].device
    flags = [w.reshape(1).to(device) for w in windows]
    return flags[0] if len(flags) == 1 else torch.stack(flags).amin(dim=0)


class AmpHandle:
    # props: opt_levels.Properties, typed Any: opt_levels imports apex_state, whose types name
    # this module (an import circle, even for the type checker's imports).
    def __init__(self, props: Any, low: torch.dtype, device: torch.device,
                 num_losses: int, min_loss_scale: float | None, max_loss_scale: float | None,
                 hysteresis: int, verbosity: int, enabled: bool = True,
                 growth_interval: int = 2000, all_reduce_found_inf: bool = False,
                 process_group: torch.distributed.ProcessGroup | None = None,
                 attribute_overflow: bool = True) -> None:
        self.props = props
        self.low = low
        self.device = device
        self.verbosity = verbosity
        self.enabled = enabled
        self.bindings: list[Binding] = []
        self.hooks: list[_Hook] = []
        self.models: list[torch.nn.Module] = []
        self.no_sync_watches: list[NoSyncWatch] = []
        self.all_reduce = bool(all_reduce_found_inf) or process_group is not None
        self.process_group = process_group
        dynamic = props.loss_scale == "dynamic"
        init = 2.0**16 if dynamic else float(props.loss_scale)
        self.scalers = [
            LossScaler(init, dynamic=dynamic, hysteresis=hysteresis, min_scale=min_loss_scale,
                       max_scale=max_loss_scale, growth_interval=growth_interval, device=device)
            for _ in range(num_losses)
        ]
        self.reporter = OverflowReporter(self, log)
        self.attribute_overflow = attribute_overflow
        self.param_names = ParamNames()  # the models' names, for overflow reports

    # ---- binding models and optimizers ---------------------------------------------------

    def name_model(self, model: torch.nn.Module) -> None:
        """Overflow reports name `model`'s params by their module-qualified names."""
        self.param_names.add(model, "amp.initialize")

    def watch_model(self, model: torch.nn.Module) -> None:
        """Masters follow weights loaded into `model` with load_state_dict."""
        self.models.append(model)
        self.hooks.append(LoadCapture(model, self._mastered, self._loaded))

    def watch_no_sync(self, model: torch.nn.Module) -> None:
        """Notices DDP's no_sync around `model`'s forward, whatever the level: every unscaling
        kind moves grads out of DDP's reach (see _refuse_unsynced_unscale)."""
        watch = NoSyncWatch(model)
        self.no_sync_watches.append(watch)
        self.hooks.append(watch)

    def _mastered(self) -> set[int]:
        return {id(p) for b in self.bindings for p, _ in b.master_pairs()}

    def _loaded(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        loaded = {id(p): value for p, value in pairs}
        for b in self.bindings:
            b.load_into_masters(loaded)

    def bind(self, optimizer: Any, fp32_originals: dict[torch.Tensor, torch.Tensor]) -> Binding:
        """Decides how `optimizer` is unscaled and skipped; `fp32_originals` maps each model
        param cast to the low dtype to a copy of its fp32 value from before the cast."""
        fused = isinstance(optimizer, FusedOptimizer)
        # Masters for the params amp cast down, or (cast_model_type=False) for the params the
        # user made low precision.
        wants_masters = self.props.master_weights and (
            self.props.cast_model_type in (torch.float16, torch.bfloat16) or bool(fp32_originals))
        if fused:
            if wants_masters:
                # New groups (add_param_group) get masters too, as apex gave them. The cast
                # params' masters start from their fp32 values, which the cast rounded.
                optimizer.set_master_weights(True)
                optimizer.set_masters({p: fp32_originals[p] for p in optimizer_params(optimizer)
                                       if p in fp32_originals})
            kind = "fold" if len(self.scalers) == 1 else "inplace"
            binding = Binding(optimizer, kind, self.device,
                              attribute_overflow=self.attribute_overflow)
        elif wants_masters:
            binding = Binding(optimizer, "masters", self.device,
                              self._swap_in_masters(optimizer, fp32_originals),
                              attribute_overflow=self.attribute_overflow)
        else:
            binding = Binding(optimizer, "inplace", self.device,
                              attribute_overflow=self.attribute_overflow)
        self.bindings.append(binding)
        return binding

    @staticmethod
    def _swap_in_masters(optimizer: Any, fp32_originals: dict[torch.Tensor, torch.Tensor]
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if p not in fp32_originals:
                    continue
                master = torch.nn.Parameter(fp32_originals[p], requires_grad=p.requires_grad)
                group["params"][i] = master
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                pairs.append((p, master))
        return pairs

    @staticmethod
    def new_master(param: torch.Tensor) -> torch.Tensor:
        return torch.nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)

    def binding_of(self, optimizer: object) -> Binding:
        for binding in self.bindings:
            if binding.optimizer is optimizer:
                return binding
        raise RuntimeError("amp: this optimizer was not passed to amp.initialize.")

    def sync_with_model(self) -> None:
        """New param groups get masters; masters follow model weights written by others."""
        for b in self.bindings:
            b.adopt_new_params(self.new_master)
            if b.fused:
                b.inner.follow_masters()
            else:
                b.follow_model()

    # ---- scale_loss -----------------------------------------------------------------------
    # The bookkeeping around a loss's backward and an optimizer's step (Binding._before_step,
    # _after_step) runs outside Dynamo: inside a torch.compile'd training step it sets and
    # deletes attributes of the optimizer, which Dynamo 2.11 cannot track on an optimizer
    # reached through amp's objects (an AssertionError, not a graph break). Each call is a
    # graph break instead, and runs as in eager mode.

    @torch._disable_dynamo
    def before_backward(self, bindings: Sequence[Binding], loss_id: int) -> torch.Tensor:
        """Returns the scale to multiply this loss by: the scale of the grads a fused
        optimizer already accumulated in this step (so that like adds to like), else the
        scaler's current one."""
        for b in bindings:
            b.adopt_new_params(self.new_master)
            b.before_backward()
        windows = [b.window for b in bindings if b.kind == "fold" and b.window is not None]
        scale = windows[0] if windows else self.scalers[loss_id].scale.clone()
        for b in bindings:
            if b.kind != "fold":
                continue
            if b.window is None:
                b.window = scale
            elif b.window is not scale:
                # Two fused optimizers that accumulated under different scales (each stepped
                # on its own) meet in one loss: bring the second to the first's scale.
                self._rescale_grads(b, scale)
        return scale

    @staticmethod
    def _rescale_grads(b: Binding, scale: torch.Tensor) -> None:
        grads = grads_of(b.params_with_grads())
        if grads:
            window = cast(torch.Tensor, b.window)  # before_backward's caller: not None
            ratio = (scale.double() / window.double()).float().reshape(1)
            torch.ops.ampfuse.multi_tensor_unscale_(grads, torch.zeros_like(ratio), ratio)
        b.window = scale

    @torch._disable_dynamo
    def after_backward(self, bindings: Sequence[Binding], loss_id: int, scale: torch.Tensor,
                       delayed: bool) -> None:
        for b in bindings:
            b.delayed = delayed
        if delayed:
            return
        self._refuse_unsynced_unscale(bindings)
        scaler = self.scalers[loss_id]
        scaler.begin_step()
        counted = _overflow_counted_this_step(bindings)
        for b in bindings:
            b.unscale(scaler, scale)
        if self.all_reduce:
            self._all_reduce(scaler.found_inf)
        host_inf = None
        if any(b.kind != "fold" and not b.fused for b in bindings):
            host_inf = bool(scaler.found_inf.item() != 0.0)
        for b in bindings:
            b.decide(scaler, scale, host_inf)
        scaler.update(counted_already=counted)
        self.reporter.step()

    def _refuse_unsynced_unscale(self, bindings: Sequence[Binding]) -> None:
        """Unscaling moves a micro-batch's grads out of .grad (into fp32 master grads or a
        stash), where DDP's all-reduce of a later synced backward never sees them: the ranks
        would silently train on different gradients. Fused optimizers keep grads in place."""
        if not any(w.unsynced for w in self.no_sync_watches):
            return
        if all(b.kind == "fold" for b in bindings):
            return
        raise RuntimeError(
            "amp.scale_loss: this loss's forward ran under DistributedDataParallel.no_sync(), "
            "and on exit scale_loss would unscale its gradients out of .grad (into the fp32 "
            "master grads or amp's accumulation stash), where the next synced backward's "
            "all-reduce never sees them, so the ranks would train on different gradients. Pass "
            "delay_unscale=True to scale_loss for the no_sync micro-batches (apex's recipe: "
            "only the last, synced micro-batch unscales), or use an ampfuse fused optimizer, "
            "which keeps the gradients in place until its step."
        )

    def _all_reduce(self, found_inf: torch.Tensor) -> None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "amp.scale_loss: amp.initialize(all_reduce_found_inf=True / process_group=...) "
                "asks for the overflow flag to be all-reduced, but torch.distributed is not "
                "initialized; call torch.distributed.init_process_group() first."
            )
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)

    # ---- reading and checkpoints ----------------------------------------------------------

    def skipped_counts(self) -> list[torch.Tensor | None]:
        """Device tensors counting each optimizer's skipped steps (None where none yet)."""
        return [b.skipped for b in self.bindings]

    def skipped_steps(self) -> int:
        """Optimizer steps skipped for overflow (the most over this handle's optimizers: they
        skip together). Several overflowing losses in one step count once."""
        counts = [int(c.item()) for c in self.skipped_counts() if c is not None]
        return max(counts, default=0)

    def last_overflow(self, optimizer: object | None = None) -> OverflowReport | None:
        """None if the optimizer's latest checked step was clean, else an OverflowReport (reads
        the device flags). Its latest checked step: the one in progress if scale_loss checked
        its grads since the last optimizer.step(), else the last step."""
        if not self.attribute_overflow:
            raise RuntimeError(
                "amp.last_overflow: overflow attribution was turned off with "
                "amp.initialize(..., attribute_overflow=False)."
            )
        if optimizer is None:
            if len(self.bindings) > 1:
                raise ValueError(
                    f"amp.last_overflow: amp.initialize was given {len(self.bindings)} "
                    "optimizers; pass the optimizer whose last step you are asking about."
                )
            if not self.bindings:
                return None
            binding = self.bindings[0]
        else:
            binding = self.binding_of(optimizer)
        # attribute_overflow: every binding has its StepAttribution.
        record = cast(StepAttribution, binding.attribution).latest()
        return None if record is None else record.report(self.param_names, binding.locate)

    def state_dict(self) -> dict[str, Any]:
        self.sync_with_model()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checkpoint.load_state_dict(self, state)
