"""Policies: what a rematerialized region keeps for the backward pass.

A policy decides, for each operation that runs inside a region, what happens to
its output in the backward pass (:class:`Decision`). Policies are frozen
dataclasses: they print as what they are, compare by value and hash, so they can
be used as cache keys.

NOTE [ How a policy is asked ]
1. For each aten op the region runs, the engine calls ``decide_op(op, args,
   kwargs)`` once, in the forward pass, and keeps the *verdict* it returns (any
   hashable value; for simple policies a :class:`Decision`).
2. The decision for an output is ``decide(verdict, name)``, where ``name`` is the
   ``checkpoint_name`` the value was tagged with, or ``None``. Names are applied
   after the op ran, which is why the verdict is kept: a combined policy needs
   each part's verdict to decide a named value exactly.
3. Policies whose decision never depends on the op (``uses_ops`` false) and on
   names (``uses_names`` false) are asked once, with ``op=None``; the engine then
   runs the region without a per-op dispatch mode, which is what makes
   ``nothing_saveable`` as cheap as ``torch.utils.checkpoint``.

NOTE [ Names override the op's decision ]
1. ``decide(verdict, None)`` is the decision for the op's output.
2. A value tagged with a ``checkpoint_name`` may get another decision:
   ``save_only_these_names("a")`` saves values named "a" and nothing else;
   ``save_anything_except_these_names("a")`` saves every output except the
   values named "a".
3. ``save_from_both_policies(a, b)`` keeps a value if either part keeps it: its
   verdict is the pair of the parts' verdicts and its decision is the ``max`` of
   the parts' decisions for the same name.
"""

from ._policy.adapters import FromCallable as FromCallable
from ._policy.adapters import FromSelectiveCheckpoint as FromSelectiveCheckpoint
from ._policy.adapters import SaveTheseOps as SaveTheseOps
from ._policy.adapters import from_callable as from_callable
from ._policy.adapters import from_selective_checkpoint as from_selective_checkpoint
from ._policy.adapters import save_these_ops as save_these_ops
from ._policy.base import Decision as Decision
from ._policy.base import Policy as Policy
from ._policy.base import PolicyLike as PolicyLike
from ._policy.budget import MemoryBudget as MemoryBudget
from ._policy.budget import memory_budget as memory_budget
from ._policy.library import Dots as Dots
from ._policy.library import EverythingSaveable as EverythingSaveable
from ._policy.library import NothingSaveable as NothingSaveable
from ._policy.library import SaveFromBothPolicies as SaveFromBothPolicies
from ._policy.library import SaveLast as SaveLast
from ._policy.library import checkpoint_dots as checkpoint_dots
from ._policy.library import (
    checkpoint_dots_with_no_batch_dims as checkpoint_dots_with_no_batch_dims,
)
from ._policy.library import dots_saveable as dots_saveable
from ._policy.library import dots_with_no_batch_dims_saveable as dots_with_no_batch_dims_saveable
from ._policy.library import everything_saveable as everything_saveable
from ._policy.library import nothing_saveable as nothing_saveable
from ._policy.library import offload_dot_with_no_batch_dims as offload_dot_with_no_batch_dims
from ._policy.library import offload_dots as offload_dots
from ._policy.library import save_from_both_policies as save_from_both_policies
from ._policy.library import save_last as save_last
from ._policy.names import SaveAndOffloadOnlyTheseNames as SaveAndOffloadOnlyTheseNames
from ._policy.names import SaveAnyNamesButThese as SaveAnyNamesButThese
from ._policy.names import SaveAnythingExceptTheseNames as SaveAnythingExceptTheseNames
from ._policy.names import SaveOnlyTheseNames as SaveOnlyTheseNames
from ._policy.names import save_and_offload_only_these_names as save_and_offload_only_these_names
from ._policy.names import save_any_names_but_these as save_any_names_but_these
from ._policy.names import save_anything_except_these_names as save_anything_except_these_names
from ._policy.names import save_only_these_names as save_only_these_names
from ._policy.strings import names as names
from ._policy.strings import register as register
from ._policy.strings import resolve as resolve

__all__ = [
    "PolicyLike",
    "Decision",
    "Policy",
    # policy objects
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    "offload_dots",
    "save_last",
    # factories
    "offload_dot_with_no_batch_dims",
    "save_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_and_offload_only_these_names",
    "save_from_both_policies",
    "save_these_ops",
    "from_callable",
    "from_selective_checkpoint",
    "memory_budget",
    # strings
    "resolve",
    "register",
    "names",
    # classes
    "EverythingSaveable",
    "NothingSaveable",
    "Dots",
    "SaveLast",
    "SaveOnlyTheseNames",
    "SaveAnyNamesButThese",
    "SaveAnythingExceptTheseNames",
    "SaveAndOffloadOnlyTheseNames",
    "SaveFromBothPolicies",
    "SaveTheseOps",
    "FromCallable",
    "FromSelectiveCheckpoint",
    "MemoryBudget",
]
