"""The functional API: :func:`mla_decode`, :func:`mla_prefill` and :func:`write_kv`, a thin
client of the engine pair (:mod:`mla.engine.backend`).

Each call checks its arguments at the door, takes a cached plan (a backend sized for the call's
shapes, :mod:`~mla.engine.functional.plan_cache`) and runs one step through that backend's
builder and op bodies; under ``torch.compile`` each call is one op
(:mod:`~mla.engine.functional.ops`).
"""

from mla.engine.functional.decode import mla_decode
from mla.engine.functional.prefill import mla_prefill
from mla.engine.functional.write import write_kv

__all__ = ["mla_decode", "mla_prefill", "write_kv"]
