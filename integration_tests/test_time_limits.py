"""pytest-timeout's limits: integration tests get 900 s (Ray and several model-stack imports on a loaded machine),
unit tests keep the pytest config's 300 s, and a test's own ``timeout`` marker wins."""

from __future__ import annotations

import pytest


@pytest.mark.integration
def test_integration_tests_get_the_longer_limit(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (900,)


def test_unit_tests_keep_the_configured_limit(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("timeout") is None
    assert float(request.config.getini("timeout")) == 300.0


@pytest.mark.integration
@pytest.mark.timeout(1234)
def test_a_tests_own_limit_wins(request: pytest.FixtureRequest) -> None:
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (1234,)
