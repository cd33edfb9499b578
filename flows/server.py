"""The temporary Prefect server of ``python -m flows``, in its own session and ended with the run's process.

Prefect starts its ephemeral server as a child in the command's process group, so a signal sent to the whole group
(``timeout``, systemd, a terminal's Ctrl-C) stopped the server with the run: the flow then retried the dead server
for minutes and ended with ``internal error: ConnectError`` (146 s, exit 1, where a SIGTERM to the process alone ends
with 143 in seconds). Here the server runs in a session of its own, so only the run's process stops it (as Prefect
does at exit, or ``flows.cli`` on a signal), and it ends by itself once that process is gone, even killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

# Run uvicorn as ``python -m uvicorn`` does, and SIGTERM itself (uvicorn's orderly stop) when the process that
# started it is gone: a new session no longer ends with the command's process group.
GUARD = """\
import os, runpy, signal, sys, threading, time
parent = int(sys.argv.pop(1))
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
threading.Thread(target=watch, daemon=True).start()
sys.argv[0] = "uvicorn"
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""


def own_session_server() -> Any:
    """The process's ephemeral server (``SubprocessASGIServer()``): one that starts in its own session.

    Prefect looks its server up as ``SubprocessASGIServer()`` (one instance per port, the default ``None``); the
    instance made here is that one, so every later start or stop of Prefect's reaches it. A server Prefect made
    before this call is returned as it is.
    """
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class OwnSessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:  # Prefect's command, in a session of its own
            app = ["--app-dir", str(prefect.__module_path__.parent)]
            app += ["--factory", "prefect.server.api.server:create_app"]
            where = ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
            env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
            settings = get_current_settings().to_environment_variables(exclude_unset=True)
            return subprocess.Popen([sys.executable, "-c", GUARD, str(os.getpid()), *app, *where],
                                    env={**os.environ, **env, **settings}, start_new_session=True)  # fmt: skip

    return OwnSessionServer()
