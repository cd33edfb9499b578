"""deployments/stack.py without a server: re-deploy only what changed (stack_deploy.plan), the port check, the UI."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"symfuse_test_{name}", REPO / "deployments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sd = load("stack_deploy")
stack = load("stack")
PROJECT = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
ENTRIES = {d["name"]: d for d in PROJECT["deployments"]}


def file_and_server(name: str = "watch-checkpoints"):
    """The file's view and a server view equal to it (as right after a deploy), and the record of that deploy."""
    file = sd.file_view(ENTRIES[name], PROJECT["pull"])
    server = {k: v for k, v in file.items() if k != "triggers"} | {"paused": False}
    return file, server, sd.record_entry(file, server)


def edited(view: dict, **changes) -> dict:
    return {**view, **changes}


def test_new_deployments_are_deployed_and_unchanged_ones_left_alone():
    file, server, record = file_and_server()
    assert sd.plan("w", file, None, None).action == "deploy"
    decision = sd.plan("w", file, server, record)
    assert (decision.action, decision.line) == ("unchanged", "unchanged w")


def test_a_ui_edit_is_kept_and_named_when_the_file_did_not_change():
    file, server, record = file_and_server()
    params = {"config": {**file["parameters"]["config"], "run_id": "edited-in-ui"}}
    decision = sd.plan("w", file, edited(server, parameters=params), record)
    assert decision.action == "kept"
    assert (
        decision.line
        == "kept w as edited on the server (parameters); prefect.yaml unchanged: --force resets it to prefect.yaml"
    )
    forced = sd.plan("w", file, edited(server, parameters=params), record, force=True)
    assert forced.action == "deploy" and forced.line.endswith("reset what the server had edited: parameters")


def test_a_file_change_is_deployed_and_ui_edited_parameters_are_put_back():
    file, server, record = file_and_server()
    params = {"config": {**file["parameters"]["config"], "run_id": "edited-in-ui"}}
    decision = sd.plan("w", edited(file, tags=["symfuse", "new"]), edited(server, parameters=params), record)
    assert decision.action == "deploy" and decision.restore == {"parameters": params}
    assert decision.line == "deployed w: prefect.yaml changed (tags), keeping its parameters as edited on the server"
    plain = sd.plan("w", edited(file, description="new words"), server, record)
    assert (plain.action, plain.restore) == ("deploy", {})


def test_conflicts_and_edits_a_deploy_would_reset_are_kept():
    file, server, record = file_and_server()
    both = sd.plan(
        "w", edited(file, parameters={"config": {}}), edited(server, parameters={"config": {"x": 1}}), record
    )
    assert (
        both.action == "kept" and "edited on the server (parameters) and prefect.yaml changed (parameters)" in both.line
    )
    paused = [{**file["schedules"][0], "active": False}]
    schedule = sd.plan("w", edited(file, tags=["t"]), edited(server, schedules=paused), record)
    assert schedule.action == "kept" and "(schedules)" in schedule.line and "--force" in schedule.line
    trigger = sd.plan("w", edited(file, triggers=[{"type": "event"}]), server, record)
    assert trigger.action == "deploy" and "(triggers)" in trigger.line


def test_without_a_record_ui_fields_that_differ_count_as_edited_on_the_server():
    file, server, _ = file_and_server()
    params = {"config": {"run_id": "by-hand"}}
    decision = sd.plan("w", file, edited(server, parameters=params), None)
    assert decision.action == "deploy" and decision.restore == {"parameters": params}
    paused = [{**file["schedules"][0], "active": False}]
    assert sd.plan("w", file, edited(server, schedules=paused), None).action == "kept"
    assert sd.plan("w", file, server, None).action == "deploy"  # the record is made


def test_file_view_of_the_project_and_flow_names():
    from flows.pipeline import fusion_pipeline
    from flows.stages import finetune_stage, stats_stage
    from flows.watch import remerge, watch_checkpoints

    flows = {f.fn.__name__: f.name for f in (fusion_pipeline, finetune_stage, stats_stage, remerge, watch_checkpoints)}
    for name, entry in ENTRIES.items():
        assert sd.flow_name(entry["entrypoint"], REPO) == flows[entry["entrypoint"].split(":")[1]], name
    view = sd.file_view(ENTRIES["watch-checkpoints"], PROJECT["pull"])
    assert view["schedules"] == [{"kind": "interval", "value": 600.0, "active": True}]
    assert view["work_pool"]["name"] == "control" and view["pull_steps"] == PROJECT["pull"]
    assert view["concurrency"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert sd.record_name("remerge") == "symfuse_deployments-remerge"


def test_port_check_accepts_time_wait_but_not_a_listener():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's (asyncio's) server socket
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.listen()
    assert not stack.port_free("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server side closes first: its end of the connection stays in TIME_WAIT on `port`
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # the old check: "port is taken" for ~60 s after stop
    assert stack.port_free("127.0.0.1", port)


def test_server_env_points_the_ui_at_the_given_port(tmp_path):
    env = stack.server_env(tmp_path, "http://127.0.0.1:4610/api")
    assert env["PREFECT_UI_API_URL"] == env["PREFECT_API_URL"] == "http://127.0.0.1:4610/api"
