"""The ``gluon`` kernel provider: Hopper-native MLA decode kernels written in Triton's Gluon
dialect, composed with the Triton provider for the contracts they do not implement.

Importing this package imports triton (not the Gluon kernels, which load on first decode);
``mla.providers.get_provider("gluon")`` does so lazily.
"""

from mla.providers.gluon.provider import GluonProvider

__all__ = ["GluonProvider"]
