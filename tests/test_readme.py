"""README's two set-up commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_lines = [line.strip() for line in readme.splitlines() if "pip install" in line and "pytest" in line]
    assert len(test_lines) == 1, test_lines
    assert test_lines[0] in ci


def test_readme_demo_command_installs_the_demo_extra():
    readme = (ROOT / "README.md").read_text()
    demo_lines = [line for line in readme.splitlines() if "pip install" in line and "quantkit demo" in line]
    assert len(demo_lines) == 1 and ".[demo]" in demo_lines[0]
