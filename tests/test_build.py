"""The installed package: native module, build report, lazy public API."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import echopipe


def test_build_info_reports_backends_and_versions() -> None:
    info = echopipe.build_info()
    assert info["version"] == echopipe.__version__
    assert isinstance(info["cuda_compiled"], bool)
    assert isinstance(info["cuda_devices"], int) and info["cuda_devices"] >= 0
    assert info["memory_kind"] in {"pinned", "pageable"}
    if info["cuda_devices"] == 0:
        assert info["memory_kind"] == "pageable"
    if info["dali_plugin_built"]:
        assert info["dali_built_version"], "a built plugin must record the DALI version it targets"
    import torch

    assert info["torch_version"] == torch.__version__


def test_import_is_lazy_and_cheap() -> None:
    # Importing the package must not pull in torch, DALI or the native module.
    code = (
        "import sys, echopipe; "
        "heavy = [m for m in ('torch', 'nvidia.dali', 'echopipe._C') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_unknown_attribute_names_itself() -> None:
    try:
        echopipe.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_version_is_written_once() -> None:
    # pyproject.toml is the only place: the package metadata, CMake and the modules follow it.
    from echopipe.native import build_config
    from echopipe.native import core as _C

    assert _C.__version__ == echopipe.__version__ == build_config()["version"]


def test_benchmark_drivers_are_not_in_the_product() -> None:
    # Neither in _C nor as a module of the package: the wheel holds what users import, and the
    # drivers are built only into a checkout's build/bench/ (ECHOPIPE_BUILD_BENCH=ON).
    from echopipe.native import core as _C
    from echopipe.native import native_dir

    assert not [name for name in dir(_C) if "bench" in name]
    assert importlib.util.find_spec("echopipe._bench_native") is None
    assert not list(native_dir().glob("*bench*"))
