"""The assertion the bad-input tests share: a call refused with the error naming its argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mla import InvalidInputError


def expect_invalid(argument: str, call: Callable[[], object], match: str | None = None) -> InvalidInputError:
    """Run ``call``, which must raise :class:`~mla.InvalidInputError` naming ``argument`` (with a
    message matching the regex ``match``, when given); returns the error."""
    with pytest.raises(InvalidInputError, match=match) as info:
        call()
    assert info.value.argument == argument, str(info.value)
    return info.value
