"""The ``aiter`` kernel provider: AMD aiter's MLA kernels on ROCm (gfx942, gfx950).

Importing this package does not import aiter; :class:`AiterProvider` detects and probes it on
first use. See ``docs/rocm.md``.
"""

from mla.providers.aiter.detect import AiterLibrary, detect_aiter
from mla.providers.aiter.probes import AiterProbes, Probe, probe_library
from mla.providers.aiter.provider import AiterProvider

__all__ = ["AiterLibrary", "AiterProbes", "AiterProvider", "Probe", "detect_aiter", "probe_library"]
