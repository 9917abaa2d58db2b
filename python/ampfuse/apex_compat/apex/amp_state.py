"""apex.amp._amp_state, the module scripts import apex's global amp state from
(``from apex.amp._amp_state import _amp_state``, then ``_amp_state.loss_scalers[0]``): here the
same names as ampfuse.amp's."""

from ampfuse.amp import _amp_state, master_params

__all__ = ["_amp_state", "master_params"]
