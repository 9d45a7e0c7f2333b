"""Shared fixtures: the device every connector test runs on.

KVGEN_TEST_DEVICES=cpu,cuda picks devices; by default CPU plus every CUDA / XPU device
present. A device that is asked for but absent is skipped, never silently replaced.
"""

from __future__ import annotations

import os

import pytest

from kvgen.runtime import available_devices


def _devices() -> list[str]:
    asked = os.environ.get("KVGEN_TEST_DEVICES")
    return [d.strip() for d in asked.split(",") if d.strip()] if asked else available_devices()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", _devices(), indirect=True)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    if request.param not in available_devices():
        pytest.skip(f"device {request.param} is not available here")
    return request.param


@pytest.fixture(params=["native", "torch"])
def copy_backend(request: pytest.FixtureRequest) -> str:
    """The copy path of a transfer test: the compiled CPU kernel, then the generated torch
    copies (the fallback and readable reference); each runs the same checks."""
    from kvgen.runtime import native

    if request.param == "native" and native.unavailable():
        pytest.skip(f"the compiled kernel cannot run here: {native.unavailable()}")
    return request.param
