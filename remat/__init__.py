"""remat: JAX's ``jax.checkpoint`` for PyTorch.

Rematerialize (recompute) a function's intermediate values in the backward pass
instead of holding them, chosen per operation by a named policy, on pytrees, in
eager autograd and under ``torch.func``.
"""

from . import compat as compat
from . import policies as policies
from . import testing as testing
from ._api import checkpoint as checkpoint
from ._api import checkpoint_name as checkpoint_name
from ._api import remat as remat
from ._apply import apply as apply
from ._capture.stateful import register_stateful as register_stateful
from ._engines.budget_plans import BudgetPlan as BudgetPlan
from ._errors import NondeterministicRecomputeError as NondeterministicRecomputeError
from ._errors import RematError as RematError
from ._errors import RematWarning as RematWarning
from ._errors import SavedInputMutatedError as SavedInputMutatedError
from ._inspect.budget import budget_plan as budget_plan
from ._inspect.compare import PolicyCost as PolicyCost
from ._inspect.compare import compare as compare
from ._inspect.compare import policy_costs as policy_costs
from ._inspect.memory import MemoryReport as MemoryReport
from ._inspect.memory import measure_memory as measure_memory
from ._inspect.residuals import Residual as Residual
from ._inspect.residuals import print_saved_residuals as print_saved_residuals
from ._inspect.residuals import residual_totals as residual_totals
from ._inspect.residuals import saved_residuals as saved_residuals
from ._modules import is_wrapped as is_wrapped
from ._modules import unwrap as unwrap
from ._modules import wrap as wrap
from ._offload.cuda import CudaHostStore as CudaHostStore
from ._offload.selection import use_host_store as use_host_store
from ._offload.store import HostStore as HostStore
from ._sequential import sequential as sequential
from ._state import is_recomputing as is_recomputing

__all__ = [
    "BudgetPlan",
    "budget_plan",
    "CudaHostStore",
    "HostStore",
    "MemoryReport",
    "NondeterministicRecomputeError",
    "PolicyCost",
    "RematError",
    "RematWarning",
    "Residual",
    "SavedInputMutatedError",
    "apply",
    "checkpoint",
    "checkpoint_name",
    "compat",
    "compare",
    "is_recomputing",
    "is_wrapped",
    "measure_memory",
    "policies",
    "policy_costs",
    "print_saved_residuals",
    "register_stateful",
    "remat",
    "residual_totals",
    "saved_residuals",
    "sequential",
    "testing",
    "unwrap",
    "use_host_store",
    "wrap",
]

__version__ = "0.1.0"
