"""Static checks of deployments/: prefect.yaml and automations.yaml parse with Prefect's own models and point at
real flows whose parameters accept what the file (and the event trigger) passes."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter

from symfuse.config import RunConfig

REPO = Path(__file__).resolve().parents[2]
PREFECT_FILE = REPO / "deployments" / "prefect.yaml"
AUTOMATIONS_FILE = REPO / "deployments" / "automations.yaml"
EXPECTED = {
    "fusion-pipeline": "flows/pipeline.py:fusion_pipeline",
    "watch-checkpoints": "flows/watch.py:watch_checkpoints",
    "remerge": "flows/watch.py:remerge",
    "finetune-stage": "flows/stages.py:finetune_stage",
    "stats-stage": "flows/stages.py:stats_stage",
}
# What the pipeline's fan-out tasks (tasks/fanout.py) pass to the stage deployments.
STAGE_PARAMS = {
    "finetune-stage": {"dataset": "isear"},
    "stats-stage": {"model": "isear", "model_uri": "s3://bucket/runs/demo/models/isear", "kind": "gram"},
}
EVENT = "symfuse.checkpoint.arrived"


def raw() -> dict:
    return yaml.safe_load(PREFECT_FILE.read_text())


def deployments() -> dict[str, dict]:
    return {d["name"]: d for d in raw()["deployments"]}


def load_flow(entrypoint: str):
    """The flow object behind an entrypoint, or skip when the other helper's file is not there yet."""
    file, func = entrypoint.split(":")
    if not (REPO / file).is_file():
        pytest.skip(f"{file} not written yet (the pipeline helper owns flows/); entrypoint {entrypoint} unchecked")
    from prefect.flows import load_flow_from_entrypoint

    cwd = os.getcwd()
    os.chdir(REPO)  # entrypoints are relative to the repository root, where `prefect deploy` runs
    try:
        return load_flow_from_entrypoint(f"{REPO / file}:{func}")
    finally:
        os.chdir(cwd)


def test_prefect_yaml_validates_with_prefects_model():
    from prefect.cli.deploy._models import PrefectYamlModel

    model = PrefectYamlModel.model_validate(raw())
    assert {d.name: d.entrypoint for d in model.deployments} == EXPECTED
    pools = {d.name: d.work_pool.name for d in model.deployments}
    # the watcher lists the store and emits events: its own pool, never a GPU worker's slot
    assert pools == {"fusion-pipeline": "gpu", "remerge": "gpu", "watch-checkpoints": "control",
                     "finetune-stage": "gpu", "stats-stage": "gpu"}  # fmt: skip
    for dep in model.deployments:
        assert "symfuse" in dep.tags, f"{dep.name}: the crash automation matches runs by the tag 'symfuse'"
    # the code's folder in the images, not the deploying machine's checkout
    assert model.pull == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/symfuse"}}]
    assert "git_clone" in PREFECT_FILE.read_text(), "the repository-based variant is documented next to it"


def test_runs_forward_library_logs_and_leave_hub_access_to_the_worker():
    for dep in raw()["deployments"]:
        env = dep["work_pool"]["job_variables"]["env"]
        assert "symfuse" in env["PREFECT_LOGGING_EXTRA_LOGGERS"].split(","), dep["name"]
        assert "HF_HUB_OFFLINE" not in env and "HF_DATASETS_OFFLINE" not in env, dep["name"]
    stack = stack_module()
    env = stack.server_env(Path("/tmp/h"))
    assert "symfuse" in env["PREFECT_LOGGING_EXTRA_LOGGERS"].split(",")
    shell = (REPO / "deployments" / "local_stack.sh").read_text()
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    assert "PREFECT_LOGGING_EXTRA_LOGGERS=${PREFECT_LOGGING_EXTRA_LOGGERS:-symfuse" in shell
    assert "symfuse" in compose["x-symfuse-env"]["PREFECT_LOGGING_EXTRA_LOGGERS"].split(",")


def test_a_burst_of_checkpoints_yields_one_remerge():
    deps = deployments()
    for name in ("remerge", "watch-checkpoints"):
        assert deps[name]["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}, name
    assert "id=event_id(" in (REPO / "flows" / "watch.py").read_text()


def test_the_ui_form_offers_strategies_and_symmetries_as_choices():
    from prefect.utilities.callables import parameter_schema

    from symfuse.merge import MERGERS
    from symfuse.symmetry.registry import kind_names  # the kinds the pipeline matches (per module or whole)

    for name in ("fusion-pipeline", "watch-checkpoints", "remerge"):
        flow = load_flow(deployments()[name]["entrypoint"])
        props = parameter_schema(flow).model_dump()["definitions"]["RunConfig"]["properties"]
        assert set(props["strategies"]["items"]["enum"]) == set(MERGERS), name
        assert set(props["symmetries"]["items"]["enum"]) == set(kind_names("weights")), name
    flow = load_flow(EXPECTED["fusion-pipeline"])
    bad = RunConfig.demo().model_dump(mode="json") | {"strategies": ["simple", "regmaen"]}
    with pytest.raises(Exception, match="regmaen"):  # refused when the run is created, before any work
        flow.validate_parameters({"config": bad})


def test_schedules_and_triggers():
    from prefect.events.schemas.deployment_triggers import DeploymentTriggerTypes

    deps = deployments()
    assert not deps["fusion-pipeline"].get("schedules") and not deps["fusion-pipeline"].get("triggers")
    (schedule,) = deps["watch-checkpoints"]["schedules"]
    assert schedule["interval"] > 0 and schedule["active"] is True
    (trigger,) = TypeAdapter(list[DeploymentTriggerTypes]).validate_python(deps["remerge"]["triggers"])
    assert trigger.expect == {EVENT} and trigger.enabled
    assert trigger.match.root == {"prefect.resource.id": "symfuse.run.*"}
    assert trigger.parameters == {
        "config": "{{ event.payload.config }}",
        "checkpoints": "{{ event.payload.checkpoints }}",
    }


@pytest.mark.parametrize("name", ["fusion-pipeline", "watch-checkpoints"])
def test_embedded_config_is_the_demo(name):
    config = RunConfig.model_validate(deployments()[name]["parameters"]["config"])
    assert config == RunConfig.demo(quick=False)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_entrypoints_load_and_accept_the_parameters(name):
    dep = deployments()[name]
    flow = load_flow(dep["entrypoint"])
    assert flow.fn.__name__ == dep["entrypoint"].split(":")[1]
    params = dict(dep.get("parameters") or {})
    if name == "remerge":  # what the trigger renders from the watcher's event payload
        params = {
            "config": RunConfig.demo(quick=True).model_dump(mode="json"),
            "checkpoints": ["s3://bucket/runs/demo-quick/incoming/ckpt"],
        }
    if name in STAGE_PARAMS:
        params = {"config": RunConfig.demo(quick=True).model_dump(mode="json"), **STAGE_PARAMS[name]}
    validated = flow.validate_parameters(params)
    assert isinstance(validated["config"], RunConfig)


def test_stage_deployments_are_the_ones_the_config_names():
    names = RunConfig.demo(quick=True).stage_deployments
    flows = {d["name"]: load_flow(d["entrypoint"]).name for d in raw()["deployments"]}
    assert names.finetune == f"{flows['finetune-stage']}/finetune-stage"
    assert names.stats == f"{flows['stats-stage']}/stats-stage"
    assert {"finetune-stage", "stats-stage"} <= {
        d["name"] for d in raw()["deployments"] if d["work_pool"]["name"] == "gpu"
    }


def test_watcher_emits_what_the_trigger_expects():
    file = REPO / "flows" / "watch.py"
    if not file.is_file():
        pytest.skip("flows/watch.py not written yet (the pipeline helper owns flows/)")
    text = file.read_text()
    assert EVENT in text
    assert "symfuse.run." in text, "the trigger matches resources named symfuse.run.<run_id>"
    assert '"config"' in text and '"checkpoints"' in text, "payload keys the trigger's parameters read"


def test_automations_validate_and_reschedule_crashed_symfuse_runs():
    from prefect.events.schemas.automations import AutomationCore

    data = yaml.safe_load(AUTOMATIONS_FILE.read_text())["automations"]
    automation = AutomationCore.model_validate(next(a for a in data if a["name"] == "symfuse-reschedule-crashed"))
    assert automation.name == "symfuse-reschedule-crashed" and automation.enabled
    assert automation.trigger.expect == {"prefect.flow-run.Crashed"}
    assert automation.trigger.match_related.root == {"prefect.resource.id": "prefect.tag.symfuse"}
    (action,) = automation.actions
    assert (action.type, action.state.value) == ("change-flow-run-state", "SCHEDULED")


def test_zombie_runs_are_marked_crashed_after_missed_heartbeats():
    """Prefect's documented zombie detection: no flow-run event for `within` seconds after a heartbeat -> Crashed."""
    from prefect.events.schemas.automations import AutomationCore, Posture

    data = yaml.safe_load(AUTOMATIONS_FILE.read_text())["automations"]
    zombies = AutomationCore.model_validate(next(a for a in data if a["name"] == "symfuse-crash-zombies"))
    trigger = zombies.trigger
    assert zombies.enabled and trigger.posture == Posture.Proactive
    assert (trigger.after, trigger.expect) == ({"prefect.flow-run.heartbeat"}, {"prefect.flow-run.*"})
    assert trigger.for_each == {"prefect.resource.id"} and trigger.threshold == 1
    assert trigger.match_related.root == {"prefect.resource.id": "prefect.tag.symfuse"}
    (action,) = zombies.actions
    assert (action.type, action.state.value) == ("change-flow-run-state", "CRASHED")
    heartbeat = int(
        raw()["definitions"]["work_pools"]["gpu"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]
    )
    assert heartbeat >= 30 and trigger.within.total_seconds() >= 3 * heartbeat, "three missed heartbeats, not one"


def test_stage_deployments_take_the_stage_queue_and_pipelines_the_default_one():
    stages = {d["name"]: d["work_pool"]["work_queue_name"] for d in raw()["deployments"]}
    assert stages["finetune-stage"] == stages["stats-stage"] == stack_module().STAGE_QUEUE
    assert stages["fusion-pipeline"] == stages["remerge"] == "default"


def test_stack_workers_one_stage_worker_per_device_sharing_the_machines_slots():
    specs = stack_module().worker_specs(["0", "1"], "box")
    names = [name for name, _, _ in specs]
    assert names == ["gpu-worker-box", "gpu-stages-box-gpu0", "gpu-stages-box-gpu1"]
    (_, pipeline, env), *stage = specs
    assert pipeline[-2:] == ["--work-queue", "default"] and "--limit" not in pipeline
    assert env == {"SYMFUSE_DEVICE_SLOTS": "box"}
    for (_, args, env), gpu in zip(stage, ["0", "1"], strict=True):
        assert args[args.index("--limit") + 1] == "1" and args[args.index("--work-queue") + 1] == "stages"
        assert env == {"SYMFUSE_DEVICE_SLOTS": "box", "CUDA_VISIBLE_DEVICES": gpu}
    (_, cpu_args, cpu_env) = stack_module().worker_specs([], "box", cpu_slots=3)[1]
    assert cpu_args[cpu_args.index("--limit") + 1] == "3" and cpu_env["SYMFUSE_CPU_SLOTS"] == "3"


def stack_module():
    spec = importlib.util.spec_from_file_location("symfuse_deploy_stack", REPO / "deployments" / "stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stack_script_matches_the_project_file():
    stack = stack_module()
    pools = {d["work_pool"]["name"] for d in raw()["deployments"]}
    assert pools == {stack.POOL, stack.CONTROL_POOL} and stack.POOL == stack.GPU_TAG
    ok, missing = stack.deployable_names()
    assert set(ok) | set(missing) == set(EXPECTED)
    assert stack.load_automations()[0]["name"] == "symfuse-reschedule-crashed"
    shell = REPO / "deployments" / "local_stack.sh"
    assert shell.stat().st_mode & stat.S_IXUSR
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=" in shell.read_text()
    subprocess.run(["bash", "-n", str(shell)], check=True)
    res = subprocess.run([sys.executable, str(REPO / "deployments" / "stack.py"), "--help"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert "start" in res.stdout and "stop" in res.stdout


def test_stack_stop_terminates_workers_before_the_server(tmp_path, monkeypatch):
    stack = stack_module()
    order = []
    monkeypatch.setattr(stack, "_alive", lambda pid: True)
    monkeypatch.setattr(stack, "_terminate", lambda pid, sig, grace: order.append(pid))
    (tmp_path / "server.pid").write_text("100")
    (tmp_path / "worker-0.pid").write_text("200")
    (tmp_path / "worker-1.pid").write_text("201")
    assert stack.stop(tmp_path) == [200, 201, 100]
    assert order == [200, 201, 100]
    assert not list(tmp_path.glob("*.pid"))


def test_stack_start_refuses_a_taken_port(tmp_path):
    import socket

    stack = stack_module()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(RuntimeError, match="is taken"):
            stack.start(port=sock.getsockname()[1], gpus=[], home=tmp_path, workers=False)
    assert stack.status(tmp_path) == {}


def test_the_local_stack_deploys_with_the_checkout_as_working_directory(tmp_path):
    stack = stack_module()
    data = yaml.safe_load(stack.local_project_file(tmp_path).read_text())
    assert data["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    assert data["deployments"] == raw()["deployments"]
    assert raw()["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "/opt/symfuse"


@pytest.mark.parametrize(
    ("field", "bad", "says"),
    [
        ({"run_id": "my run"}, "my run", "does not match"),
        ({"anchor": "../isear"}, "../isear", "does not match"),
        ({"merge_params": {"regmaen": {}}}, "regmaen", "is not one of"),
        ({"merge_params": {"ties": {"densty": 0.3}}}, "densty", "not allowed"),
        ({"merge_params": {"ties": {"density": 3}}}, "3", "maximum"),
    ],
)
def test_the_ui_form_refuses_bad_names_anchors_and_merge_params_at_creation(field, bad, says):
    """The server checks a new run's parameters against this schema (enforce_parameter_schema): refused at creation."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    schema = parameter_schema(load_flow(EXPECTED["fusion-pipeline"])).model_dump()
    good = RunConfig.demo().model_dump(mode="json")
    assert validate({"config": good | {"merge_params": {"ties": {"density": 0.3}}}}, schema) == []
    errors = [e.message for e in validate({"config": good | field}, schema)]
    assert errors and any(bad in m and says in m for m in errors), errors
