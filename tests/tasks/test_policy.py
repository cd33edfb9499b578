"""Retry classification and OOM batch halving (no Prefect runtime; the retry loop itself is tested in tests/flows)."""

import types

import pytest
import torch

from symfuse.errors import CheckpointError
from symfuse.store import ArtifactNotFound, CorruptArtifact, IncompleteDownload
from tasks import policy


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA driver error: unknown error"),
        ConnectionError("store backend unreachable"),
        TimeoutError("read timed out"),
        OSError("store operation failed (ClientError: 503 SlowDown)"),
        IncompleteDownload("3 of 700 bytes arrived while the store's file is whole"),
        policy.InjectedFault("injected"),
    ],
)
def test_transient(exc):
    assert policy.is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("shape mismatch"),
        CheckpointError("L00.attn q holds NaN or inf values"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        RuntimeError("CUDA error: device-side assert triggered"),
        FloatingPointError("loss is NaN"),
        ArtifactNotFound("no artifact at memory:///runs/x"),
        CorruptArtifact("manifest.json is not valid JSON"),  # the store's bytes: every read finds the same
        PermissionError("access denied"),
        KeyError("q"),
        TypeError("bad argument"),
        AssertionError("not orthogonal"),
    ],
)
def test_deterministic(exc):
    assert not policy.is_transient(exc)


def _state(exc):
    return types.SimpleNamespace(data=exc)


def test_retry_condition_counts_oom_and_halves_batch(monkeypatch):
    run = types.SimpleNamespace(id="run-1", name="finetune-isear")
    ctx = types.SimpleNamespace(task_run=run)
    monkeypatch.setattr(policy, "_run_context", lambda: ctx)
    assert policy.batch_settings(16, 1) == (16, 1)
    assert policy.retry_transient(None, run, _state(torch.OutOfMemoryError("CUDA out of memory")))
    assert policy.batch_settings(16, 1) == (8, 2)
    assert policy.retry_transient(None, run, _state(RuntimeError("CUDA out of memory. Tried to allocate")))
    assert policy.batch_settings(16, 3) == (4, 12)
    assert policy.retry_transient(None, run, _state(ConnectionError("lost")))  # retried, batch unchanged
    assert policy.batch_settings(16, 1) == (4, 4)
    assert not policy.retry_transient(None, run, _state(ValueError("NaN loss")))
    assert policy.batch_settings(6, 1) == (3, 2)  # odd: stops halving, effective batch kept
    policy._OOM_COUNTS.pop("run-1")


def test_fault_injection_first_attempt_only(monkeypatch):
    run = types.SimpleNamespace(id="r", name="match-isear-L00.attn", run_count=1)
    ctx = types.SimpleNamespace(task_run=run, task=types.SimpleNamespace(name="match_module"))
    monkeypatch.setattr(policy, "_run_context", lambda: ctx)
    monkeypatch.setenv(policy.FAIL_ONCE_ENV, "finetune, match-*-L00.attn")
    with pytest.raises(policy.InjectedFault, match=r"match-isear-L00\.attn"):
        policy.maybe_inject_fault()
    run.run_count = 2
    policy.maybe_inject_fault()  # the retry goes through
    run.run_count = 1
    monkeypatch.setenv(policy.FAIL_ONCE_ENV, "match_module:oom")
    with pytest.raises(torch.OutOfMemoryError):
        policy.maybe_inject_fault()
    monkeypatch.setenv(policy.FAIL_ONCE_ENV, "finetune")
    policy.maybe_inject_fault()  # another task: nothing


def test_no_context_no_fault(monkeypatch):
    monkeypatch.setenv(policy.FAIL_ONCE_ENV, "*")
    policy.maybe_inject_fault()  # outside Prefect (.fn() calls) nothing is injected
    assert policy.batch_settings(16, 1) == (16, 1)
