"""Every command's ``--help`` lists every one of its options (and the app's lists every command)."""

import pytest
import typer
from typer.testing import CliRunner

import symfuse.cli.commands  # noqa: F401  (registers the commands)
from symfuse.cli import app

GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)


def test_every_command_is_registered():
    assert {"merge", "match", "match-many", "disguise", "stats", "finetune", "barrier", "evaluate"} <= set(COMMANDS)
    out = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    for name in COMMANDS:
        assert name in out, name


@pytest.mark.parametrize("name", COMMANDS)
def test_help_lists_every_option(name):
    command = GROUP.commands[name]
    r = CliRunner().invoke(app, [name, "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    assert options, name
    for p in options:
        long = [o for o in p.opts if o.startswith("--")]
        assert long and all(o in r.output for o in long), (name, p.opts, r.output)
        assert p.help, (name, p.opts)  # every option says what it does


def test_merge_help_shows_every_strategy_on_an_80_column_terminal():
    from symfuse.merge.registry import MERGERS

    out = CliRunner().invoke(app, ["merge", "--help"], terminal_width=80).output
    assert "…" not in out, out  # nothing cut
    words = set(out.replace(",", " ").replace(".", " ").split())
    assert set(MERGERS.names()) <= words, out
