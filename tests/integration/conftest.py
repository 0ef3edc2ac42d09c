"""Fixtures shared by the integration modules that talk to one subprocess server."""

from __future__ import annotations

import pytest

from tools.harness.server import serving


@pytest.fixture(scope="module")
def srv(tmp_path_factory, demo_path):
    """A server of the module's own (on the tiny model) with a custom ceiling far above
    what it needs: everything stays ok. A module may override it with other flags."""
    with serving(tmp_path_factory.mktemp("srv"), "--memory-guard-gb", "8",
                 "--poll-active", "0.2") as s:
        yield s


@pytest.fixture()
def stubs(srv):
    """(control, inference) stubs on one channel to `srv`."""
    with srv.stubs() as pair:
        yield pair
