"""Fake ``aiter.utility.dtypes``: fp8 is e4m3fnuz on gfx942, e4m3fn on gfx950, uint8 elsewhere."""

from __future__ import annotations

import torch

from aiter.jit.utils.chip_info import get_gfx

fp8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}.get(get_gfx(), torch.uint8)
bf16 = torch.bfloat16
fp16 = torch.float16
fp32 = torch.float32
i32 = torch.int32
u64 = torch.uint64
