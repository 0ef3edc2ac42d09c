"""Fixtures for the real-memory-limit tests: child cgroups and servers inside them
(`tools.harness.cgroup`, `tools.harness.server`).

Teardown order matters and is guaranteed by the fixture graph: `servers` depends on
`cgroups`, so every server is stopped (SIGKILL if it does not stop) before its cgroup
is destroyed, and destroying a cgroup SIGKILLs whatever is still inside it (a balloon,
a stuck server) before removing the directory — also when the test failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tools.harness.cgroup import CgroupUnavailable, ChildCgroup, remove_leftovers
from tools.harness.server import ServerProcess, start_server


@pytest.fixture(scope="session")
def cgroup_support() -> None:
    """Skip (with the reason) where no child memory cgroup can be made."""
    try:
        probe = ChildCgroup.create(256 << 20)
    except CgroupUnavailable as exc:
        pytest.skip(f"real memory-limit tests need a child memory cgroup: {exc.reason}")
    probe.destroy()
    removed = remove_leftovers()
    if removed:
        print(f"removed {len(removed)} empty leftover cgroup(s): {removed}")


@pytest.fixture()
def cgroups(cgroup_support) -> Iterator[Callable[[int], ChildCgroup]]:
    made: list[ChildCgroup] = []

    def make(limit_bytes: int) -> ChildCgroup:
        try:
            cg = ChildCgroup.create(limit_bytes)
        except CgroupUnavailable as exc:
            pytest.skip(exc.reason)
        made.append(cg)
        return cg

    yield make
    errors = []
    for cg in reversed(made):
        try:
            cg.destroy()
        except OSError as exc:
            errors.append(f"{cg.path}: {exc}")
    assert not errors, f"could not remove cgroup(s): {errors}"


@pytest.fixture()
def servers(cgroups, tmp_path) -> Iterator[Callable[..., ServerProcess]]:
    """start(*args, cgroup=None, wait=True) -> ServerProcess; all stopped at teardown."""
    started: list[ServerProcess] = []

    def start(
        *args: str, cgroup: ChildCgroup | None = None, wait: bool = True, tmp: Path | None = None
    ) -> ServerProcess:
        prefix = cgroup.prefix() if cgroup is not None else None
        srv = start_server(tmp or tmp_path, *args, prefix=prefix, wait=wait)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        with contextlib.suppress(Exception):
            srv.stop(sig=9, timeout=10)  # throwaway servers: no drain
