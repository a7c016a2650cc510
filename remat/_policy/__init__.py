"""The policy language: the interface, aten op classes, JAX's policies, adapters, strings.

Layers inside, lowest first: ``base`` (Decision, Policy) < ``ops`` (aten classes) <
``library`` (JAX's policies) and ``adapters`` (op lists, callables, torch's selective
checkpoint functions) < ``strings`` (the grammar and registry); ``contexts`` (the
policy of a torch ``context_fn``) uses ``adapters``.
"""

from __future__ import annotations

from . import base, library, strings


def _combine(a: base.Policy | str, b: base.Policy | str) -> base.Policy:
    return library.save_from_both_policies(strings.resolve(a), strings.resolve(b))


base.install_combiner(_combine)
