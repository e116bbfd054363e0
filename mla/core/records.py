"""Fast construction of frozen records on hot paths.

A frozen slotted attrs class sets each field through ``object.__setattr__`` in its generated
``__init__`` (a frozen class's own ``__setattr__`` raises), about 0.1 µs a field on a CPU; a
keyword call adds the binding of each keyword. :func:`fast_constructor` makes a constructor
that writes each slot through its descriptor instead, about half the cost, for the records a
per-step build makes (``builder.build`` makes a handful per step).

Contract: ``fast_constructor(cls)(**fields)`` returns an instance of ``cls`` equal, field by
field, to ``cls(**fields)``, for a class whose generated ``__init__`` does nothing but store its
arguments: frozen, slotted, no validators, converters, ``on_setattr`` hooks, ``init=False``
fields, hash caching or ``__attrs_pre_init__``/``__attrs_post_init__`` (:func:`fast_constructor`
raises ``TypeError`` for any other class, so a record that gains a validator later cannot be
built unchecked). Every field must be passed (defaults are not applied), by name or in field
order. The public constructor stays the one to use wherever values come from a caller.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

T = TypeVar("T")


def fast_constructor(cls: type[T]) -> Callable[..., T]:
    """A constructor of ``cls`` that sets its slots directly (see the module docstring for the
    contract); raises ``TypeError`` when ``cls`` is not a plain frozen slotted attrs record."""
    if not attrs.has(cls) or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a slotted attrs class")
    try:  # a frozen class's own __setattr__ refuses every name
        cls.__setattr__(object.__new__(cls), "_fast_constructor_probe", None)
    except attrs.exceptions.FrozenInstanceError:
        pass
    except AttributeError:  # a mutable slotted class: no such slot
        raise TypeError(f"{cls.__name__} is not frozen") from None
    else:
        raise TypeError(f"{cls.__name__} is not frozen")
    if hasattr(cls, "__attrs_pre_init__") or hasattr(cls, "__attrs_post_init__"):
        raise TypeError(f"{cls.__name__} has an __attrs_pre_init__ or __attrs_post_init__")
    if hasattr(cls, "_attrs_cached_hash"):
        raise TypeError(f"{cls.__name__} caches its hash")
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    names = []
    for field in attrs.fields(cls):
        if field.validator is not None or field.converter is not None or not field.init:
            raise TypeError(f"{cls.__name__}.{field.name} has a validator, a converter or init=False")
        if field.on_setattr not in (None, attrs.setters.NO_OP):
            raise TypeError(f"{cls.__name__}.{field.name} has an on_setattr hook")
        descriptor = getattr(cls, field.name)
        if type(descriptor) is not types.MemberDescriptorType:
            raise TypeError(f"{cls.__name__}.{field.name} is not a slot")
        namespace[f"_set_{field.name}"] = descriptor.__set__
        names.append(field.name)
    body = "".join(f"    _set_{name}(self, {name})\n" for name in names)
    source = f"def make({', '.join(names)}):\n    self = _new(_cls)\n{body}    return self\n"
    exec(compile(source, f"<fast constructor of {cls.__name__}>", "exec"), namespace)
    make: Callable[..., T] = namespace["make"]
    make.__doc__ = f"{cls.__name__}(...) without attrs' generated __init__ (mla.core.records)."
    return make
