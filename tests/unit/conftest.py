"""Fixtures shared by the unit tests of the connector's halves (test_connector_halves, test_connector_waits,
test_hybrid_groups, test_tails): the copy device factory, parametrized over both kinds, and a prompt.
They cost nothing by themselves.
"""

from __future__ import annotations

import pytest

from connector.device import FaultyDevice, HostDevice
from connector.emulated_cuda import EmulatedCudaDevice
from tests.kits.halves import prompt


@pytest.fixture(params=["host", "emulated-cuda"])
def dev(request):
    """A factory of copy devices of the parametrized kind: ``dev(delay=S, fail=f)``."""

    def make(delay: float | None = None, fail=None):
        if request.param == "host":
            if delay is None and fail is None:
                return HostDevice()
            return FaultyDevice(delay=delay or 0.0, fail=fail)
        return EmulatedCudaDevice(**({} if delay is None else {"delay": delay}), fail=fail)

    return make


@pytest.fixture
def tokens():
    """A 600-token prompt."""
    return prompt(600)
