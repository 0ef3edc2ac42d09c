"""Commands run side by side: for tests that need several independent interpreters."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


def run_side_by_side(commands: Sequence[Sequence[str]], *, timeout: float = 60,
                     envs: Sequence[dict[str, str] | None] | None = None,
                     **popen) -> list[subprocess.CompletedProcess]:
    """Start every command at once, wait for all (text output captured); whatever is still
    running when one times out or the caller is interrupted is killed."""
    envs = envs if envs is not None else [None] * len(commands)
    procs: list[subprocess.Popen] = []
    try:
        for cmd, env in zip(commands, envs, strict=True):
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env, **popen))
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, outs, strict=True)]
