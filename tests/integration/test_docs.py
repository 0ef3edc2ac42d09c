"""Every command in the docs runs, so the docs cannot rot.

The fenced blocks of README.md and docs/*.md, by their info string:

- ```sh: each command runs with bash, from the repository root, the venv's bin first
  on PATH, against one live server on the tiny demo model (started by this module
  on a free port). `127.0.0.1:50051` (or `localhost:50051`) becomes that server's
  address, and a `plimsoll VERB` with no --port gets `--port <its port>`. A block's
  commands run in one shell, in order (`set -eo pipefail`), so a later command may
  use a variable an earlier one set; each must exit 0. Within a block:
  - a set-up command (`python3 -m venv ...`) is not run: it must be one of the
    README's two (serve the demo model; run the tests, exactly as `.ci/run` does);
  - `plimsoll serve ...` is not run: the real argument parser reads it (and the
    memory settings are validated), so a flag that does not exist fails;
  - a command whose comment says `until Ctrl-C` streams: once it has printed
    something it must keep running (or exit 0) for a moment, then it is interrupted.
- ```sh no-run: shown, not run (installs, long runs, root). Their `plimsoll ...` and
  `python -m tools.X` / `service.cli` commands are still checked: every flag must
  parse (plimsoll) or be in the module's --help (tools). docs/benchmarks.md's blocks
  are all taken as no-run: each is a benchmark of minutes.
- ```python: a script, run with the venv's Python against the same server.
- ```js: an ES module, run with node against the same server, with the node_modules
  of tests/clients/node (installed by `npm ci` when missing, as the Node client
  tests do). Run from the repository root, so `proto/` is where examples load it.
- ```toml: a memory config file, read by `memory.config.load_memory_config`.
- ```yaml: parsed (a collector configuration, for instance).
- ```bash, ```shell, ```console: refused; write ```sh so that the block is run.
  python/js blocks marked no-run are only compiled (`node --check`).

Relative links between the docs must resolve, anchors included, and a `--flag` named
in the prose must be an option of some `plimsoll` verb. The server runs with
`--memory-guard-gb 8`, so that the machine's other tenants cannot move it off level ok.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tools.harness.server import ROOT, start_server

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_PORT = 50051  # the port the docs show: the server's default
SHOWN_ONLY_FILES = {"docs/benchmarks.md"}  # benchmarks run for minutes: checked, not run
VENV_BIN = Path(sys.executable).parent
NODE = shutil.which("node")
NODE_DIR = ROOT / "tests" / "clients" / "node"
COMMAND_TIMEOUT_S = 30.0
STREAM_S = 0.5  # after its first output, a streaming command must keep running

SETUP_PREFIX = "python3 -m venv .venv && .venv/bin/pip install -c requirements.lock -e "


def ci_test_command() -> str:
    """The test command `.ci/run` runs (tests/unit/test_readme.py finds it the same way)."""
    ci = (ROOT / ".ci" / "run").read_text()
    return next(line for line in ci.splitlines() if "pytest" in line and "venv" in line).strip()


# -- the blocks ------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    flags: frozenset[str]
    text: str

    @property
    def doc(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runs(self) -> bool:
        return "no-run" not in self.flags and self.doc not in SHOWN_ONLY_FILES


FENCE = re.compile(r"^\s*```(.*)$")


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info = m.group(1).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if info:
            out.append(Block(path, start, info[0], frozenset(info[1:]),
                             "\n".join(body) + "\n"))
    return out


ALL_BLOCKS = [b for path in DOC_FILES for b in blocks(path)]


def of(*langs: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.lang in langs]


# -- shell commands ----------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    text: str  # as written, continuation lines included
    tokens: tuple[str, ...]  # shlex words, comments dropped

    @property
    def is_setup(self) -> bool:
        return self.tokens[:3] == ("python3", "-m", "venv")

    @property
    def streams(self) -> bool:
        return bool(re.search(r"#[^\n]*until Ctrl-C", self.text))

    def words(self) -> list[str]:
        """The first command's words: up to a pipe, a list operator or a redirection."""
        out = []
        for word in self.tokens:
            if re.fullmatch(r"\|\|?|&&?|;|\d?>>?(&\d)?|<", word):
                break
            out.append(word)
        return out

    def cli_args(self) -> list[str] | None:
        """The arguments of a `plimsoll` (or `python -m service.cli`) command, else None."""
        words = self.words()
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words.pop(0)  # VAR=value before the command
        if not words:
            return None
        if Path(words[0]).name == "plimsoll":
            return words[1:]
        if Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "service.cli"]:
            return words[3:]
        return None

    @property
    def is_serve(self) -> bool:
        args = self.cli_args()
        return bool(args) and args[0] == "serve"

    def tools_module(self) -> tuple[str, list[str]] | None:
        """(module, its arguments) for `python -m tools.X ...`."""
        words = self.words()
        if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1] == "-m" \
                and words[2].startswith("tools."):
            return words[2], words[3:]
        return None


def commands(text: str) -> list[Command]:
    """A block's commands: continuation lines joined, a quote left open goes on to the
    next line; blank lines and comment lines skipped."""
    out: list[Command] = []
    acc = ""
    for line in text.splitlines():
        if not acc and (not line.strip() or line.lstrip().startswith("#")):
            continue
        acc = f"{acc}\n{line}" if acc else line
        if acc.endswith("\\"):
            continue
        try:
            tokens = shlex.split(acc.replace("\\\n", " "), comments=True)
        except ValueError:
            continue  # an open quote: the command goes on
        out.append(Command(acc, tuple(tokens)))
        acc = ""
    assert not acc, f"unterminated command: {acc!r}"
    return out


def readme_setup_commands() -> list[str]:
    """The set-up commands of the README, in order."""
    return [c.text.strip() for b in ALL_BLOCKS if b.doc == "README.md" and b.lang == "sh"
            for c in commands(b.text) if c.is_setup]


# The only set-up commands a doc may show: the README's two (serve; run the tests).
SETUP_COMMANDS = tuple(readme_setup_commands())


def localize(cmd: str, port: int) -> str:
    """The docs' address (127.0.0.1:50051) and the CLI's default port → the test server's."""
    cmd = re.sub(rf"\b(?:127\.0\.0\.1|localhost):{DOC_PORT}\b", f"127.0.0.1:{port}", cmd)

    def add_port(m: re.Match) -> str:
        if m.group("verb") not in client_verbs():
            return m.group(0)  # serve, plot: no server to reach
        return f"{m.group(0)} --port {port}"

    if "--port" not in cmd:
        cmd = re.sub(r"(?:\bplimsoll|-m service\.cli)[ \t]+(?P<verb>[a-z][\w-]*)\b",
                     add_port, cmd)
    return cmd


@cache
def verb_parsers() -> dict:
    """The CLI's verb → its argparse parser."""
    import argparse

    from service import cli

    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@cache
def client_verbs() -> frozenset[str]:
    """The CLI verbs that call a server: those with --port, except serve."""
    return frozenset(name for name, p in verb_parsers().items()
                     if name != "serve" and "--port" in p._option_string_actions)


def check_cli(args: list[str], where: str) -> None:
    """`plimsoll ARGS` parses with the real parser; serve's memory settings validate."""
    from service import cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsed = cli.build_parser().parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{where}: `plimsoll {shlex.join(args)}` does not parse "
                    f"(exit {exc.code}): {err.getvalue().strip()}")
    options = verb_parsers()[parsed.command]._option_string_actions
    for word in args[1:]:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag not in options:  # argparse takes abbreviations
            pytest.fail(f"{where}: `plimsoll {parsed.command}` has no flag {flag} "
                        "(spell it out in full)")
    if parsed.command == "serve" and parsed.memory_config is None:
        try:
            cli.memory_config(parsed)
        except cli.CliError as exc:
            pytest.fail(f"{where}: `plimsoll {shlex.join(args)}`: {exc}")


@cache  # many blocks name the same tool; its --help does not change
def module_help(module: str) -> str:
    """What `python -m MODULE --help` prints, run in this process: a tool's imports (MLX,
    mlx-lm) are already loaded here, and a fresh interpreter for each took 1-2 s."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = [module, "--help"]
    code: object = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            # A tool a test imported already runs again as __main__, as `python -m` would.
            warnings.filterwarnings("ignore", "'tools.", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # argparse's --help ends with exit 0
        code = exc.code
    finally:
        sys.argv = argv
    assert code in (0, None), f"python -m {module} --help: exit {code}: {err.getvalue()[-2000:]}"
    return out.getvalue()


def check_static(cmd: Command, where: str) -> None:
    """What a command that is not run must still satisfy."""
    if cmd.is_setup:
        assert cmd.text.strip() in SETUP_COMMANDS, (
            f"{where}: a set-up command that is not one of the README's two:\n"
            f"  {cmd.text.strip()}\nexpected one of:\n  " + "\n  ".join(SETUP_COMMANDS))
        return
    args = cmd.cli_args()
    if args is not None:
        check_cli(args, where)
        return
    tool = cmd.tools_module()
    if tool is not None:
        module, targs = tool
        help_text = module_help(module)
        for word in targs:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])",
                                                       help_text):
                pytest.fail(f"{where}: `python -m {module}` has no flag {flag}")


def shell_env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_script(cmds: list[str], where: str) -> None:
    script = "\n".join([
        "set -eo pipefail",
        "trap 'echo \"docs: this command failed: $BASH_COMMAND\" >&2' ERR",
        *cmds,
    ])
    timeout = COMMAND_TIMEOUT_S * len(cmds)
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=shell_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a timeout ends its children too
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{where}: timed out after {timeout:.0f}s (a command that streams "
                    f"needs '# ... until Ctrl-C'):\n{script}\n--- stderr\n{stderr[-2000:]}")
    assert proc.returncode == 0, (
        f"{where}: exit {proc.returncode}\n--- script\n{script}\n--- stdout\n"
        f"{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}")


def run_streaming(cmd: str, where: str, tmp_path: Path) -> None:
    """Runs until it has printed something and STREAM_S more, then is interrupted: it
    must still be running then, or have exited 0."""
    out = tmp_path / "stream.out"
    with open(out, "wb") as fh:
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=shell_env(), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and not out.stat().st_size:
            time.sleep(0.05)
        assert out.stat().st_size or proc.poll() is not None, (
            f"{where}: printed nothing in {COMMAND_TIMEOUT_S:.0f}s: {cmd}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STREAM_S)
        rc = proc.poll()
        text = out.read_text(errors="replace")
        assert rc in (None, 0), f"{where}: exit {rc}: {cmd}\n{text[-3000:]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory, demo_path):
    """`plimsoll serve` as the quick start starts it, on a free port, with a fixed 8 GiB
    ceiling (as the other integration servers have): what the machine's other tenants
    do cannot move it off level ok, so every example's answer is the same everywhere."""
    srv = start_server(tmp_path_factory.mktemp("docs"), "--memory-guard-gb", "8")
    yield srv
    srv.stop()


# -- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("block", of("sh"), ids=lambda b: b.id)
def test_sh_block(block: Block, docs_server, tmp_path):
    cmds = commands(block.text)
    assert cmds, f"{block.id}: an empty block"
    if not block.runs:
        for cmd in cmds:
            check_static(cmd, block.id)
        return
    group: list[str] = []
    for cmd in cmds:
        if cmd.is_setup or cmd.is_serve:
            check_static(cmd, block.id)
        elif cmd.streams:
            if group:
                run_script(group, block.id)
                group = []
            run_streaming(localize(cmd.text, docs_server.port), block.id, tmp_path)
        else:
            group.append(localize(cmd.text, docs_server.port))
    if group:
        run_script(group, block.id)


@pytest.mark.parametrize("block", of("python"), ids=lambda b: b.id)
def test_python_block(block: Block, docs_server, tmp_path):
    if not block.runs:
        compile(block.text, block.id, "exec")
        return
    script = tmp_path / "example.py"
    script.write_text(localize(block.text, docs_server.port))
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=shell_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (
        f"{block.id}: exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-3000:]}")


@pytest.fixture(scope="module")
def node_modules() -> Path:
    if NODE is None:
        pytest.skip("node is not on PATH")
    needed = [NODE_DIR / "node_modules" / "@grpc" / p / "package.json"
              for p in ("grpc-js", "proto-loader")]
    if not all(p.exists() for p in needed):
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not on PATH to install tests/clients/node")
        result = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"npm ci failed:\n{result.stderr[-3000:]}"
    return NODE_DIR / "node_modules"


@pytest.mark.parametrize("block", of("js"), ids=lambda b: b.id)
def test_js_block(block: Block, docs_server, node_modules, tmp_path):
    (tmp_path / "node_modules").symlink_to(node_modules, target_is_directory=True)
    script = tmp_path / "example.mjs"
    script.write_text(localize(block.text, docs_server.port))
    cmd = [NODE, "--check", str(script)] if not block.runs else [NODE, str(script)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (
        f"{block.id}: exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n"
        f"--- stderr\n{result.stderr[-3000:]}")


@pytest.mark.parametrize("block", of("toml"), ids=lambda b: b.id)
def test_toml_block_is_a_valid_memory_config(block: Block, tmp_path):
    from memory.config import load_memory_config

    path = tmp_path / "memory.toml"
    path.write_text(block.text)
    load_memory_config(path)


@pytest.mark.parametrize("block", of("yaml", "yml"), ids=lambda b: b.id)
def test_yaml_block_parses(block: Block):
    yaml = pytest.importorskip("yaml")
    assert isinstance(yaml.safe_load(block.text), dict), block.id


def test_no_shell_block_escapes_the_runner():
    """```bash and friends would not be run: the docs say ```sh (or ```sh no-run)."""
    wrong = [b.id for b in of("bash", "shell", "console", "zsh", "shell-session")]
    assert not wrong, f"write ```sh (or ```sh no-run) so these run: {wrong}"


def test_the_set_up_commands_are_the_readmes_two_and_ci_runs_the_test_one():
    """Exactly two set-up commands on a fresh machine: one serves the demo model, one
    runs the tests (the very line `.ci/run` runs, which tests/unit/test_readme.py finds
    in the README too). Every doc that shows one shows it as the README does."""
    serve, test = readme_setup_commands()  # exactly two
    assert test == ci_test_command()
    assert serve.startswith(SETUP_PREFIX) and test.startswith(SETUP_PREFIX)
    assert serve.endswith("&& .venv/bin/plimsoll serve"), serve
    # The optimized BLAS comes with the serve command, no extra step (engine/blas.py).
    assert "-e '.[blas]'" in serve, serve
    for b in of("sh"):
        for c in commands(b.text):
            if c.is_setup:
                assert c.text.strip() in (serve, test), (
                    f"{b.id}: not one of the README's set-up commands: {c.text.strip()}")


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, in_code = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            out.add(slug(m.group(1)))
    return out


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        assert dest.exists(), f"{path.name}: broken link {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{path.name}: no heading #{anchor} in {dest.name}"


@pytest.mark.parametrize("path", [p for p in DOC_FILES
                                  if p.relative_to(ROOT).as_posix() not in SHOWN_ONLY_FILES],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_flags_named_in_the_prose_exist(path: Path):
    """A `--flag` in inline code is an option of some `plimsoll` verb (docs/benchmarks.md
    names the benchmark scripts' own flags, and is left out)."""
    options: set[str] = set()
    for parser in verb_parsers().values():
        options |= set(parser._option_string_actions)
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    unknown = sorted({flag for code in re.findall(r"`([^`\n]+)`", text)
                      for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", code)
                      if flag not in options})
    assert not unknown, f"{path.name} names flags no plimsoll verb has: {unknown}"
