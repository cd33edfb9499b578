"""deployments/stack.py: options that cannot start a stack are one line and exit 2, before anything starts."""

from __future__ import annotations

import socket

import pytest

from tests.deploy.test_stack_deploy import stack


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--port", "99999"], "--port 99999: not a TCP port"),  # was an OverflowError traceback
        (["--port", "0"], "--port 0: not a TCP port"),  # hung waiting for a server on port 0
        (["--gpus", "a,b"], "['a', 'b'] are not GPU indices or UUIDs"),  # started workers for GPUs not there
        (["--gpus", "0,0"], "a GPU is named twice"),
        (["--gpus", "7"], "GPU 7 not visible here (visible: none)"),
        (["--home", "{file}"], "is a file — give a folder"),  # a NotADirectoryError traceback
        (["--home", "{file}/sub"], "is a file — give a folder"),
    ],
)
def test_options_that_cannot_start_a_stack_are_one_line(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, on any machine
    (tmp_path / "f").write_text("x")
    args = [a.format(file=tmp_path / "f") for a in args]
    with pytest.raises(SystemExit) as exit_:
        stack.main(["start", *([] if "--home" in args else ["--home", str(tmp_path / "h")]), *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: --" in err[-1] and words in err[-1], err  # argparse's usage lines, then the one error line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # nothing written


def test_a_taken_port_is_one_line_and_exit_1(tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert stack.main(["start", "--port", str(port), "--home", str(tmp_path / "h"), "--gpus", ""]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is taken: pass --port or stop what listens there"
    ]
