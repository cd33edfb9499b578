"""Re-deploy only what changed, never silently reverting what was edited on the server (the UI).

``deployments/stack.py start`` / ``setup`` call :func:`plan` for each deployment of ``prefect.yaml`` and run
``prefect deploy`` only for those it marks ``deploy``:

- missing on the server: deployed;
- ``prefect.yaml`` unchanged since the last deploy: left alone (a schedule keeps its anchor, the UI's edits stay;
  fields edited on the server are named in a ``kept`` line);
- ``prefect.yaml`` changed: deployed, unless a field that changed there was also edited on the server, or the
  server's edits are in fields a deploy would reset other than the parameters (then ``kept``, with the fields named;
  ``--force`` deploys the file's). Parameters edited on the server are put back right after the deploy.

What "the last deploy" was is recorded on the server in the Prefect variable ``symfuse_deployments``: for every
deployment, a short hash of each field as the file defined it and as the server showed it right after the deploy
(so a field is "edited on the server" exactly when the server now shows something else). A deployment without a
record (deployed by hand, or by an older stack) counts as changed in the file; its parameters and schedules that
differ from the file count as edited on the server.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD = "symfuse_deployments"
UI_FIELDS = ("parameters", "schedules")  # what a record-less deployment may have had edited in the UI
RESTORABLE = {"parameters"}  # server edits a deploy resets but :func:`restore` puts back


@dataclass
class Decision:
    """What to do with one deployment, and the one line that says why."""

    name: str
    action: str  # "deploy", "unchanged" or "kept"
    line: str
    restore: dict[str, Any] = field(default_factory=dict)  # server values to put back after the deploy


def digest(value: Any) -> str:
    """A short hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def flow_name(entrypoint: str, repo: Path) -> str:
    """The flow name of ``file.py:function`` (its ``@flow(name=...)``, else the function name with dashes)."""
    file, _, func = entrypoint.partition(":")
    tree = ast.parse((repo / file).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == func:
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call):
                    for kw in deco.keywords:
                        if kw.arg == "name" and isinstance(kw.value, ast.Constant):
                            return str(kw.value.value)
    return func.replace("_", "-")


def _schedule(item: dict[str, Any]) -> dict[str, Any]:
    kind = next((k for k in ("interval", "cron", "rrule") if k in item), None)
    value = float(item["interval"]) if kind == "interval" else item.get(kind)
    return {"kind": kind, "value": value, "active": bool(item.get("active", True))}


def file_view(dep: dict[str, Any], pull: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The fields of a deployment as ``prefect.yaml`` defines it (``pull``: the project's pull steps)."""
    pool = dep.get("work_pool") or {}
    limit = dep.get("concurrency_limit")
    if isinstance(limit, dict):
        limit = {"limit": limit.get("limit"), "collision_strategy": limit.get("collision_strategy")}
    return {
        "entrypoint": dep["entrypoint"],
        "work_pool": {
            "name": pool.get("name"),
            "queue": pool.get("work_queue_name"),
            "job_variables": pool.get("job_variables") or {},
        },
        "pull_steps": dep.get("pull", pull) or [],
        "parameters": dep.get("parameters") or {},
        "schedules": [_schedule(s) for s in dep.get("schedules") or []],
        "tags": sorted(dep.get("tags") or []),
        "description": (dep.get("description") or "").strip(),
        "enforce_parameter_schema": bool(dep.get("enforce_parameter_schema", True)),
        "concurrency": limit,
        "triggers": dep.get("triggers") or [],  # the server keeps them as automations: compared through the record
    }


def server_view(dep: Any) -> dict[str, Any]:
    """The same fields (but ``triggers``) of a deployment as the server holds it (a ``DeploymentResponse``)."""
    schedules = []
    for s in dep.schedules or []:
        sch = s.schedule
        if getattr(sch, "interval", None) is not None:
            item: dict[str, Any] = {"interval": sch.interval.total_seconds()}
        elif getattr(sch, "cron", None) is not None:
            item = {"cron": sch.cron}
        else:
            item = {"rrule": getattr(sch, "rrule", None)}
        schedules.append(_schedule({**item, "active": s.active}))
    options = dep.concurrency_options
    return {
        "entrypoint": dep.entrypoint,
        "work_pool": {
            "name": dep.work_pool_name,
            "queue": dep.work_queue_name,
            "job_variables": dep.job_variables or {},
        },
        "pull_steps": dep.pull_steps or [],
        "parameters": dep.parameters or {},
        "schedules": schedules,
        "tags": sorted(dep.tags or []),
        "description": (dep.description or "").strip(),
        "enforce_parameter_schema": bool(dep.enforce_parameter_schema),
        "paused": bool(getattr(dep, "paused", False)),  # server-only: a pause in the UI counts as an edit
        "concurrency": {
            "limit": dep.concurrency_limit,
            "collision_strategy": str(options.collision_strategy.value) if options else None,
        },
    }


def record_entry(file: dict[str, Any], server: dict[str, Any]) -> dict[str, dict[str, str]]:
    """What the record keeps of one deployment right after its deploy: each field's hash in the file and server."""
    return {"file": {k: digest(v) for k, v in file.items()}, "server": {k: digest(v) for k, v in server.items()}}


def plan(
    name: str, file: dict[str, Any], server: dict[str, Any] | None, record: dict | None, force: bool = False
) -> Decision:
    """Decide what to do with deployment ``name`` (see the module docstring).

    Args:
        name: The deployment's name.
        file: :func:`file_view` of its ``prefect.yaml`` entry.
        server: :func:`server_view` of the server's deployment, None if it has none.
        record: Its :func:`record_entry` from the last deploy, None if there is none.
        force: Deploy the file's definition whatever the server holds.
    """
    if server is None:
        return Decision(name, "deploy", f"deployed {name}: new")
    if record:
        changed = sorted(k for k, v in file.items() if digest(v) != record["file"].get(k))
        edited = sorted(k for k, v in server.items() if digest(v) != record["server"].get(k))
    else:
        changed = ["(no record of the last deploy)"]
        edited = [k for k in UI_FIELDS if server[k] != file[k]]
    if force:
        reset = f"; reset what the server had edited: {', '.join(edited)}" if edited else ""
        return Decision(name, "deploy", f"deployed {name}: --force{reset}")
    if not changed:
        if edited:
            return Decision(
                name,
                "kept",
                f"kept {name} as edited on the server ({', '.join(edited)}); "
                "prefect.yaml unchanged: --force resets it to prefect.yaml",
            )
        return Decision(name, "unchanged", f"unchanged {name}")
    both = sorted(set(changed) & set(edited))
    if both or set(edited) - RESTORABLE:
        what = ", ".join(both or sorted(set(edited) - RESTORABLE))
        return Decision(
            name,
            "kept",
            f"kept {name}: edited on the server ({what}) and prefect.yaml changed "
            f"({', '.join(changed)}); --force deploys prefect.yaml's",
        )
    restore = {k: server[k] for k in edited}
    kept = f", keeping its {', '.join(edited)} as edited on the server" if edited else ""
    return Decision(name, "deploy", f"deployed {name}: prefect.yaml changed ({', '.join(changed)}){kept}", restore)


def record_name(deployment: str) -> str:
    """The Prefect variable holding the record of one deployment's last deploy."""
    return f"{RECORD}-{deployment}"


async def read_server(flows: dict[str, str]) -> tuple[dict[str, dict | None], dict[str, dict | None]]:
    """Each deployment's :func:`server_view` (None: missing) and record (None: none), by deployment name.

    Args:
        flows: Deployment name -> its flow's name (the server names a deployment ``<flow>/<deployment>``).
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    views, records = {}, {}
    async with get_client() as client:
        for name, flow in flows.items():
            try:
                views[name] = server_view(await client.read_deployment_by_name(f"{flow}/{name}"))
            except ObjectNotFound:
                views[name] = None
            variable = await client.read_variable_by_name(record_name(name))
            records[name] = variable.value if variable is not None and isinstance(variable.value, dict) else None
    return views, records


async def finish(flows: dict[str, str], decisions: list[Decision], files: dict[str, dict]) -> None:
    """After ``prefect deploy``: put back the server-edited values, then record each deployed definition."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate, VariableCreate, VariableUpdate

    async with get_client() as client:
        for decision in decisions:
            if decision.action != "deploy":
                continue
            full = f"{flows[decision.name]}/{decision.name}"
            dep = await client.read_deployment_by_name(full)
            if decision.restore:
                await client.update_deployment(dep.id, DeploymentUpdate(**decision.restore))
                dep = await client.read_deployment_by_name(full)
            entry = record_entry(files[decision.name], server_view(dep))
            if decision.restore:  # the file's values were not deployed for these: keep them "edited on the server"
                for key in decision.restore:
                    entry["server"][key] = digest(files[decision.name][key])
            name = record_name(decision.name)
            if await client.read_variable_by_name(name) is None:
                await client.create_variable(VariableCreate(name=name, value=entry, tags=["symfuse"]))
            else:
                await client.update_variable(VariableUpdate(name=name, value=entry))
