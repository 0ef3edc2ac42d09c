"""The README's test command is the one CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if "pytest" in line and "venv" in line)
    assert command.strip() in readme
