"""Horovod's small TensorFlow helpers that scripts and test suites call by name, some by
their private names (``hvd._executing_eagerly()``, ``hvd._cache``, ``hvd.vars_to_refs``),
with Horovod's behaviour; a Keras 3 variable, which has no ``ref()``, stands for itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

__all__ = ["cache", "executing_eagerly", "make_subgraph", "refs_to_vars", "vars_to_refs"]


def executing_eagerly() -> bool:
    """Whether ops run at once (eager mode) rather than being built into a graph."""
    return tf.executing_eagerly()


def make_subgraph(f: Callable[..., Any]) -> Any:
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` memoised on its (hashable) arguments and on whether ops run eagerly."""
    cache: dict[Any, Any] = {}

    def wrapper(*args: Any) -> Any:
        key = (args, executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(variables: Any) -> Any:
    """Hashable references of variables (nested lists become tuples)."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref() if hasattr(variables, "ref") else variables


def refs_to_vars(refs: Any) -> Any:
    """The variables of :func:`vars_to_refs`'s references."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref() if hasattr(refs, "deref") else refs
