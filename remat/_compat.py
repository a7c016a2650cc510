"""Every use of private torch, in one place (layer 0: imports nothing of remat).

NOTE [ Private torch ]
1. remat works below autograd and below every functorch level, where torch has
   no public API: the functorch interpreter stack and its wrapper tensors, the
   dispatch-mode stack, dispatch-key guards, storage identity, and a few
   internals of ``torch.utils.checkpoint`` and ``torch._functorch.config``.
   Each use is a small function here whose docstring says which public route
   does not exist and which torch version it was checked against, so a torch
   upgrade is read against this file alone.
2. Outside this file remat names no private ``torch`` attribute or module
   (``tests/test_layering.py`` fails on one). Tensor attributes that torch's own
   documentation uses (``t._version``, ``t._base``, ``op._schema``) are not
   module names and stay where they are read.
3. Checked against torch 2.13. A function that an upstream change makes
   obsolete says so, and is replaced by the public call when remat requires it.
"""

from __future__ import annotations

import collections
import itertools
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch._functorch.pyfunctorch import FuncTorchInterpreter, retrieve_all_functorch_interpreters
from torch.utils import _python_dispatch
from torch.utils import _pytree as _torch_pytree

__all__ = [
    "GRAD",
    "JVP",
    "VMAP",
    "CachedCheckpointMode",
    "CachingCheckpointMode",
    "OpOverload",
    "OpOverloadPacket",
    "PlainDispatchMode",
    "TorchDispatchMode",
    "activation_memory_budget",
    "backward_keeps_graph",
    "current_autograd_node",
    "current_level",
    "detach_past_modes",
    "dispatch_mode_stack",
    "dispatch_mode_depth",
    "dynamo_frame_hook",
    "eager_forward_ad_level",
    "forward_grad_enabled",
    "functorch_disabled",
    "functorch_level",
    "global_forward_pre_hooks",
    "gradient_observed",
    "interpreters",
    "is_batched",
    "add_post_accumulate_hook",
    "is_functorch_wrapped",
    "is_traceable_wrapper_subclass",
    "keeping_version_counters",
    "modes_if_only",
    "never_traced",
    "nothing_compiles",
    "no_dispatch_modes",
    "physical",
    "stateful_module_types",
    "storage_address",
    "storage_identity",
    "torch_function_disabled",
    "torch_pytree_node",
    "torch_tree_leaves",
    "transform_active",
    "unwrap_if_dead",
    "unwrap_once",
    "view_base",
    "wrap_for_grad",
]

_functorch = torch._C._functorch

# -- op and mode types --------------------------------------------------------

#: The type of ``torch.ops.aten.mm.default``: torch exports no public alias (2.13).
OpOverload = torch._ops.OpOverload
#: The type of ``torch.ops.aten.mm``: torch exports no public alias (2.13).
OpOverloadPacket = torch._ops.OpOverloadPacket
#: The base of dispatch modes. Documented by torch, yet only in the private
#: ``torch.utils._python_dispatch`` (2.13).
TorchDispatchMode = _python_dispatch.TorchDispatchMode
#: Whether a tensor subclass implements ``__tensor_flatten__`` (private module, 2.13).
is_traceable_wrapper_subclass = _python_dispatch.is_traceable_wrapper_subclass
#: Selective checkpointing's forward mode: torch's public ``create_selective_checkpoint_contexts``
#: builds one but gives no way to extend it (2.13).
CachingCheckpointMode = _torch_checkpoint._CachingTorchDispatchMode
#: Selective checkpointing's recompute mode (see `CachingCheckpointMode`, 2.13).
CachedCheckpointMode = _torch_checkpoint._CachedTorchDispatchMode

#: functorch transform kinds, as `interpreters` reports them (no public enum, 2.13).
GRAD = _functorch.TransformType.Grad
JVP = _functorch.TransformType.Jvp
VMAP = _functorch.TransformType.Vmap

#: ``aten._to_copy``, the op ``Tensor.to(dtype)`` runs (autocast's casts, NOTE [ Autocast's
#: cast cache ] in ``_replay/cast_cache.py``): aten has no public name for it (2.13).
TO_COPY = torch.ops.aten._to_copy.default


# -- the functorch interpreter stack and its levels ---------------------------


def interpreters() -> list[FuncTorchInterpreter]:
    """The live functorch transforms (``grad``, ``vmap``, ``jvp``...), outermost first.

    Each has ``key()`` (a `GRAD`/`JVP`/`VMAP`) and ``level()``. torch.func has
    no public way to ask which transforms the caller runs under (2.13).
    """
    return retrieve_all_functorch_interpreters()


def transform_active() -> bool:
    """Whether any torch.func transform runs around the caller (no public query, 2.13).

    Dynamo always sees an interpreter here while tracing: use `current_level` there.
    """
    return _functorch.peek_interpreter_stack() is not None


def current_level() -> int | None:
    """The innermost functorch level, or None outside every transform (private, 2.13)."""
    level: int | None = _functorch.maybe_current_level()
    return level


def functorch_disabled() -> AbstractContextManager[Any]:
    """Run plain tensor ops, below every functorch level (no public guard, 2.13)."""
    return torch._C._DisableFuncTorch()


def eager_forward_ad_level() -> int:
    """The innermost live ``torch.autograd.forward_ad`` level, -1 when none.

    ``forward_ad`` asks for a ``dual_level`` to be entered, but offers no way to
    read whether one is (2.13).
    """
    return int(torch.autograd.forward_ad._current_level)


def forward_grad_enabled() -> AbstractContextManager[Any]:
    """Forward-mode AD on, inside an ``autograd.Function``'s ``jvp`` rule, which runs it off.

    ``torch.func.jvp`` turns it on the same way but enters a second eager
    ``dual_level`` when no functorch ``jvp`` is live, which torch refuses; no
    public switch exists (2.13).
    """
    return torch.autograd.forward_ad._set_fwd_grad_enabled(True)


# -- functorch wrapper tensors ------------------------------------------------


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (a grad or vmap level's tensor; private, 2.13)."""
    return bool(_functorch.is_functorch_wrapped_tensor(t))


def is_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a vmap level's wrapper (private, 2.13)."""
    return bool(_functorch.is_batchedtensor(t))


def functorch_level(t: torch.Tensor) -> int:
    """The functorch level of the wrapper ``t``; -1 for a plain tensor (private, 2.13)."""
    level: int = _functorch.maybe_get_level(t)
    return level


def unwrap_once(t: torch.Tensor) -> torch.Tensor:
    """The tensor one functorch wrapper ``t`` wraps (private, 2.13).

    torch.func unwraps only its own outputs, on exit; code that runs inside a
    transform and must see what a level wraps has no public route.
    """
    inner: torch.Tensor = _functorch.get_unwrapped(t)
    return inner


def wrap_for_grad(t: torch.Tensor, level: int) -> torch.Tensor:
    """``t`` wrapped at the grad level ``level``, not requiring grad (private, 2.13).

    What ``torch.func.grad`` does to every tensor argument it does not
    differentiate: an op may then write it in place there (BatchNorm's running
    statistics), where a tensor of an outer level is refused as "captured".
    ``torch.func.vjp`` wraps only its primals and offers no such argument.
    """
    wrapped: torch.Tensor = _functorch._wrap_for_grad(t, level)
    return wrapped


def unwrap_if_dead(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its wrapper when that wrapper's level has exited, else ``t``.

    What functorch does itself to the saved values of aten ops (private, 2.13).
    """
    inner: torch.Tensor = _functorch.unwrap_if_dead(t)
    return inner


def physical(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every functorch wrapper of ``t`` (see `unwrap_once`).

    Python code under vmap/grad sees wrapper tensors; remat's dispatch modes,
    below every level, see the physical ones.
    """
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


# -- the dispatch-mode stack and dispatch keys --------------------------------


def no_dispatch_modes() -> AbstractContextManager[Any]:
    """Run the enclosed ops seen by no dispatch mode (remat's own copies and checks).

    torch offers no public way to step outside the active modes (2.13).
    """
    return _python_dispatch._disable_current_modes()


def dispatch_mode_stack() -> list[Any]:
    """The active dispatch modes, outermost first (private, 2.13)."""
    stack: list[Any] = _python_dispatch._get_current_dispatch_mode_stack()
    return stack


def torch_function_disabled() -> AbstractContextManager[Any]:
    """Run the enclosed torch calls seen by no ``__torch_function__`` mode or subclass.

    ``torch.overrides`` has no public guard (2.13).
    """
    return torch._C.DisableTorchFunction()


def keeping_version_counters() -> AbstractContextManager[Any]:
    """Inside ``__torch_dispatch__``, make ``detach`` share its source's version counter.

    There the ADInplaceOrView key is excluded, and a plain ``detach`` would get
    a fresh counter, so in-place writes through it would go unseen. Re-including
    the key has no public route (2.13).
    """
    return torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False)


_dispatch_stack_len = torch._C._len_torch_dispatch_stack
#: How many dispatch modes are active on this thread (private, 2.13).
dispatch_mode_depth = _dispatch_stack_len
_dispatch_stack_at = torch._C._get_dispatch_stack_at
_NoPythonDispatch = torch._C._DisableTorchDispatch
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def modes_if_only(ours: tuple[type, ...]) -> list[Any] | None:
    """The active dispatch modes (fake and proxy modes included) when each is an
    instance of exactly one of ``ours``; None when another one is active.

    `dispatch_mode_stack` in C calls only, for a hot path (private, 2.13).

    Examples:
        >>> modes_if_only(())
        []
    """
    modes = []
    for i in range(_dispatch_stack_len()):
        mode = _dispatch_stack_at(i)
        if type(mode) not in ours:
            return None
        modes.append(mode)
    return modes


def detach_past_modes(t: torch.Tensor) -> torch.Tensor | None:
    """``t.detach()`` unseen by every dispatch mode, for a plain tensor ``t``; None for
    a tensor subclass (whose own ``__torch_dispatch__``, a DTensor's, must run).

    For remat's own bookkeeping where `modes_if_only` says only remat's modes
    would see the op. Outside ``__torch_dispatch__`` the alias shares ``t``'s
    version counter. torch has no public way past some modes only (2.13).

    Examples:
        >>> x = torch.ones(2)
        >>> detach_past_modes(x)._version == x._version
        True
    """
    if type(t) not in _PLAIN:
        return None
    with _NoPythonDispatch():
        return t.detach()


def current_autograd_node() -> Any:
    """The autograd node whose backward runs on this thread, or None (private, 2.13)."""
    return torch._C._current_autograd_node()


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (autograd's ``_base``), or None."""
    return t._base


def gradient_observed(t: torch.Tensor) -> bool:
    """Whether a hook or ``retain_grad()`` on ``t`` reads the gradient reaching it.

    A tensor's hooks are a private table (2.13); ``retain_grad`` is public.
    """
    return t.retains_grad or bool(t._backward_hooks)


def backward_keeps_graph() -> bool:
    """Whether the backward running on this thread keeps its graph (``retain_graph``).

    False means autograd frees each node's saved tensors once it has run, so no
    later backward can run that node again. Autograd exposes the running graph
    task's ``keep_graph`` only privately (2.13); torch.func.grad's own backward
    passes ``retain_graph=False``, a ``vjp_fn`` ``True`` by default.
    """
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def _has_python_key(t: torch.Tensor) -> bool:
    # Only Python subclasses with their own ``__torch_dispatch__`` carry the Python
    # dispatch key; a plain subclass (``nn.Parameter``) has a real storage.
    return bool(torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python))


# -- storage identity ---------------------------------------------------------


def storage_address(t: torch.Tensor) -> int:
    """The address of ``t``'s memory: what an in-place write through any alias touches.

    0 when it has none (sparse, nested, a zero tensor). A wrapper subclass
    (``_make_wrapper_subclass``) has a storage with no data pointer (touching it
    raises): a traceable one is identified by its first inner tensor, which its
    in-place ops write to; any other one has no address. torch has no public
    "is this a zero tensor / wrapper" query (2.13).

    Examples:
        >>> x = torch.ones(4)
        >>> storage_address(x[1:]) == storage_address(x) != 0
        True
    """
    if t.layout is not torch.strided or t.is_nested or t._is_zerotensor():
        return 0
    if type(t) is not torch.Tensor and _has_python_key(t):
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            inner = getattr(t, names[0], None) if names else None
            return storage_address(inner) if isinstance(inner, torch.Tensor) else 0
        return 0
    return int(t.untyped_storage().data_ptr())


def storage_identity(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage object, not of its memory; None where there is none.

    Unlike `storage_address` it survives the memory being freed and refilled
    (FSDP's ``resize_(0)`` and all-gather) and changes when ``.data = ...``
    rebinds the tensor. Tensor subclasses (DTensor) and functorch wrappers have
    no plain storage. The storage object's identity is private (``_cdata``, 2.13).

    Examples:
        >>> x = torch.ones(4)
        >>> storage_identity(x[1:]) == storage_identity(x)
        True
    """
    # (The type first, and functorch's test inline: a call per pin per region call.)
    if type(t) not in _PLAIN_TENSORS or _functorch.is_functorch_wrapped_tensor(t):
        return None
    return int(t.untyped_storage()._cdata)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


#: Keys of our entries in a tensor's post-accumulate hooks: negative, where torch's
#: own ``RemovableHandle`` ids count up from 0, so the two never meet.
_hook_keys = itertools.count(1)


def add_post_accumulate_hook(t: torch.Tensor, hook: Any) -> tuple[dict[int, Any], int]:
    """``t.register_post_accumulate_grad_hook(hook)`` without its handle: returns the
    tensor's hook table and the entry's key (``table.pop(key, None)`` removes it).

    The same table torch's method fills (autograd runs its values after each
    accumulation), without the method's handle object and checks: the module state
    guard watches every parameter a region runs, on every call (private, 2.13:
    ``_post_accumulate_grad_hooks``). ``t`` must be a leaf requiring grad.
    """
    table: dict[int, Any] | None = t._post_accumulate_grad_hooks
    if table is None:
        table = collections.OrderedDict()
        t._post_accumulate_grad_hooks = table  # the setter links it to autograd
    key = -next(_hook_keys)
    table[key] = hook
    return table, key


# -- torch.nn and torch.utils._pytree internals -------------------------------


def stateful_module_types() -> list[type]:
    """Module types of torch that update buffers in forward: batch norms, spectral norm.

    Their common bases are private (``_NormBase``, ``_SpectralNorm``, 2.13).
    """
    return [
        torch.nn.modules.batchnorm._NormBase,
        torch.nn.utils.parametrizations._SpectralNorm,  # updates its power-iteration buffers
    ]


def global_forward_pre_hooks() -> dict[int, Any]:
    """The table of global module forward pre-hooks, by key.

    ``register_module_forward_pre_hook`` adds one under a new key each time, and
    Dynamo guards on the table's keys: a fixed key avoids a recompile per region
    call, and needs the table itself (private, 2.13).
    """
    hooks: dict[int, Any] = torch.nn.modules.module._global_forward_pre_hooks
    return hooks


def torch_pytree_node(cls: type) -> Any:
    """How ``torch.utils._pytree`` flattens ``cls`` (a ``NodeDef``), or None.

    Hugging Face registers its ``ModelOutput`` containers there only; torch has
    no public pytree module to ask (2.13).
    """
    return _torch_pytree.SUPPORTED_NODES.get(cls)


def torch_tree_leaves(tree: Any) -> list[Any]:
    """``torch.utils._pytree.tree_leaves``: the pytree Dynamo traces natively (optree is
    not traced), for code that runs while Dynamo traces. No public module (2.13)."""
    leaves: list[Any] = _torch_pytree.tree_leaves(tree)
    return leaves


# -- torch.compile internals --------------------------------------------------

#: Dynamo's frame hook on this thread: None when no ``torch.compile``'d call runs
#: around the caller (frames then run as plain Python, and
#: ``torch.compiler.disable`` would only set the hook to None and back), else
#: its callback (or False in run-only mode). A builtin, called as is: a hot path.
#: torch has no public query (``torch.compiler.is_compiling`` answers whether
#: Dynamo *traces* the caller, not whether it would compile the frames the
#: caller enters; 2.13).
dynamo_frame_hook = torch._C._dynamo.eval_frame.get_eval_frame_callback


def nothing_compiles() -> bool:
    """``not torch.compiler.is_compiling() and dynamo_frame_hook() is None`` in one call.

    For hooks that torch calls from C++ (saved-tensor hooks), which Dynamo never
    traces as bytecode: outside TorchScript ``is_compiling`` is its private flag,
    which Dynamo holds set while it compiles (2.13).
    """
    return not torch.compiler._is_compiling_flag and dynamo_frame_hook() is None

_eval_frame = torch._C._dynamo.eval_frame


def never_traced(code: Any) -> None:
    """Let Dynamo's frame hook run the code object ``code`` as plain Python, never
    tracing or compiling it; the frames it calls are the hook's as usual.

    What ``torch._dynamo.eval_frame.skip_code`` does, without importing Dynamo
    (``torch.compiler.disable`` is the public route, at a cost per call; 2.13).
    """
    action = _eval_frame._FrameAction
    _eval_frame.set_code_exec_strategy(
        code, _eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT)
    )


class PlainDispatchMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` torch leaves as it is.

    torch 2.13 wraps every mode's ``__torch_dispatch__`` in ``torch.compiler.disable``
    (a few Python calls per op, also where nothing compiles). A subclass keeps
    Dynamo out itself (``_compile.UncompiledMode``). The switch is a private
    classmethod (2.13).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False



def activation_memory_budget() -> float:
    """The min-cut partitioner's activation budget (``torch._functorch.config``, 2.13).

    Below 1 the partitioner may drop saved outputs of multi-output ops; there is
    no public configuration object to read it from.
    """
    return float(torch._functorch.config.activation_memory_budget)

