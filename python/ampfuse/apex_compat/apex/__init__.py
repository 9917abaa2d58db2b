"""What ``import apex`` gives once ampfuse's apex alias is installed (see ampfuse.apex_compat).

apex.amp is ampfuse.amp itself; apex.optimizers, apex.parallel and apex.normalization take
apex's constructor arguments, in apex's order, and run on ampfuse and torch.
"""

from ampfuse import amp
from ampfuse.apex_compat import ALIAS_VERSION as __version__  # noqa: F401  (apex.__version__)
from ampfuse.apex_compat.apex import normalization, optimizers, parallel

__all__ = ["amp", "normalization", "optimizers", "parallel"]
