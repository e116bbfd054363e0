"""The providers a GPU test runs on: torch always, Triton and Gluon where they are available."""

from __future__ import annotations

import mla


def gpu_providers() -> list[str]:
    """``["torch", "triton"?, "gluon"?]``: the registered GPU providers available on this machine."""
    names = ["torch"]
    for name in ("triton", "gluon"):
        if name not in mla.provider_names():
            continue
        try:
            if mla.get_provider(name).availability():
                names.append(name)
        except mla.ProviderUnavailableError:
            continue
    return names
