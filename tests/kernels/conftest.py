"""The `isa` fixture: a kernel test that takes it runs once per instruction set this build has and
this CPU runs (skipped when the kernels are not built)."""

from __future__ import annotations

import pytest

from kernels import ext

_BUILT = ext.load() is not None


@pytest.fixture(params=ext.supported_isas() if _BUILT else ["none"])
def isa(request):
    if not _BUILT:
        pytest.skip("kernels not built")
    ext.set_cpu_isa(request.param)
    yield request.param
    ext.set_cpu_isa("auto")
