"""Detecting AMD aiter: by API and distribution, lazily, with a reason for every failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from aiter_cases import fake_provider

from mla.core.platform import simulated_platform
from mla.providers.aiter import AiterProvider
from mla.providers.aiter.capabilities import aiter_capabilities


def test_import_mla_and_constructing_the_provider_never_import_aiter() -> None:
    code = (
        "import sys, mla; from mla.providers.aiter import AiterProvider; p = AiterProvider(); "
        "p.capabilities(mla.simulated_platform('gfx950')); "
        "assert not [m for m in sys.modules if m == 'aiter' or m.startswith('aiter.')], sys.modules.keys()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_import_happens_in_the_probe_not_at_construction(fake_aiter) -> None:
    fake_aiter("gfx950")
    provider = fake_provider()
    assert "aiter" not in sys.modules
    assert provider.availability()
    assert "aiter" in sys.modules
    assert provider.library.version == "0.1.10"


def test_on_this_machine_aiter_is_missing_and_torch_is_not_rocm() -> None:
    support = AiterProvider().availability()
    assert not support
    assert "aiter-missing" in support.codes
    missing = next(r for r in support.reasons if r.code == "aiter-missing")
    assert "pip install amd-aiter" in missing.message
    assert "never `pip install aiter`" in missing.message
    if torch.version.hip is None:
        assert "not-rocm-torch" in support.codes


def test_without_aiter_the_record_is_the_simulated_one_for_the_platform_arch() -> None:
    provider = AiterProvider()
    for arch in ("gfx942", "gfx950"):
        caps = provider.capabilities(simulated_platform(arch))
        reference = aiter_capabilities(arch)
        assert caps.contracts == reference.contracts
        assert caps.paged_kernels == reference.paged_kernels
        assert caps.latent_dims == frozenset({(512, 64)})
    assert "simulated" in str(provider.describe_probes()["capabilities"])


def test_the_unrelated_pypi_aiter_is_rejected_with_a_clear_reason(fake_aiter) -> None:
    fake_aiter(package="pypi")
    support = fake_provider().availability()
    assert support.codes == ("not-amd-aiter",)
    message = support.reasons[0].message
    assert "unrelated PyPI async-iterator library" in message
    assert "distribution aiter 0.13.20191203" in message
    assert "pip uninstall aiter" in message
    assert "amd-aiter" in message


def test_the_pypi_stand_in_is_recognized_by_its_exports_without_metadata(fake_aiter) -> None:
    fake = fake_aiter(package="pypi")
    next(fake.site.glob("*.dist-info")).rename(fake.site / "gone")
    support = fake_provider().availability()
    assert "exports azip, join_aiters, map_aiter" in support.reasons[0].message


def test_both_packages_installed_explains_the_clash(fake_aiter) -> None:
    fake = fake_aiter(package="pypi")
    meta = fake.site / "amd_aiter-0.1.10.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: amd-aiter\nVersion: 0.1.10\n")
    message = fake_provider().availability().reasons[0].message
    assert "amd-aiter 0.1.10 is installed too" in message


def test_an_import_that_fails_without_rocm_is_an_availability_reason(fake_aiter) -> None:
    fake_aiter(arch=None)
    provider = fake_provider()
    support = provider.availability()
    assert support.codes == ("aiter-import-failed",)
    assert "rocminfo" in support.reasons[0].message
    assert "GPU_ARCHS" in support.reasons[0].message
    assert provider.probes is None
    assert "not available" in str(provider.describe_probes()["aiter"])


def test_a_source_build_without_the_distribution_is_accepted_by_its_api(fake_aiter) -> None:
    fake_aiter("gfx942", distribution=None)
    provider = fake_provider()
    assert provider.availability()
    assert "source build" in str(provider.describe_probes()["aiter"])


def test_a_namespace_directory_named_aiter_is_not_aiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "aiter").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    support = fake_provider().availability()
    assert support.codes == ("not-amd-aiter",)
    assert "namespace package" in support.reasons[0].message


def test_the_rocm_device_is_a_separate_reason(fake_aiter, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_aiter("gfx950")
    monkeypatch.setattr(torch.version, "hip", None)
    assert AiterProvider().availability().codes == ("not-rocm-torch",)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    support = AiterProvider().availability()
    assert support.codes == ("no-rocm-device",)
    assert "device" in AiterProvider().describe_probes()


def test_probes_are_cached_per_provider(fake_aiter) -> None:
    fake_aiter("gfx950")
    provider = fake_provider()
    assert provider.probes is provider.probes
    rows = provider.describe_probes()
    assert rows["arch"] == "gfx950 (from aiter.jit.utils.chip_info.get_gfx())"
    assert rows["fp8_dtype"] == "float8_e4m3fn"
    for key in ("gluon_small_head", "fp8_prefill", "persistent_metadata_v1", "reduce_v1", "native_h24"):
        assert str(rows[key]).startswith("yes") or key == "native_h24"
    assert rows["mla_decode_fwd"] == "takes q_scale, kv_scale, return_lse, page_size, nhead_kv"
