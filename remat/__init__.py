"""remat: JAX's ``jax.checkpoint`` for PyTorch.

Rematerialize (recompute) a function's intermediate values in the backward pass
instead of holding them, chosen per operation by a named policy, on pytrees, in
eager autograd and under ``torch.func``.
"""

from . import policies as policies
from ._api import checkpoint as checkpoint
from ._api import checkpoint_name as checkpoint_name
from ._api import remat as remat
from ._errors import NondeterministicRecomputeError as NondeterministicRecomputeError
from ._errors import RematError as RematError
from ._errors import SavedInputMutatedError as SavedInputMutatedError
from ._module_state import register_stateful as register_stateful
from ._modules import apply as apply
from ._modules import sequential as sequential
from ._modules import unwrap as unwrap
from ._modules import wrap as wrap
from ._state import is_recomputing as is_recomputing

__all__ = [
    "NondeterministicRecomputeError",
    "RematError",
    "SavedInputMutatedError",
    "apply",
    "checkpoint",
    "checkpoint_name",
    "is_recomputing",
    "policies",
    "register_stateful",
    "remat",
    "sequential",
    "unwrap",
    "wrap",
]

__version__ = "0.1.0"
