"""README promises: exactly two set-up commands, and CI runs the same test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_readme_shows_exactly_two_setup_commands():
    cmds = _setup_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds), cmds
    assert cmds[0].startswith("bash scripts/bootstrap.sh")


def test_ci_runs_the_readme_test_command():
    test_cmd = _setup_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, f"{test_cmd!r} is not a line of .ci/run"


def test_readme_scripts_exist():
    for cmd in _setup_commands():
        for script in re.findall(r"scripts/\S+\.sh", cmd):
            assert (ROOT / script).exists(), script
