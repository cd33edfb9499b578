"""fusion_pipeline end to end on tiny models: faults retried, re-runs recompute nothing, bad input fails at once."""

from __future__ import annotations

import json
import threading

import pytest

from flows.pipeline import fusion_pipeline
from symfuse.model_card import read_front_matter
from symfuse.store import ArtifactStore, layout
from tests.flows.conftest import Calls, run_logs, task_runs, tiny_config


def test_pipeline_completes_after_injected_faults(first_run):
    config, state, calls = first_run
    assert state.is_completed(), state.message
    result = state.result()
    anchor = result["anchor"]
    others = [n for n in config.dataset_names if n != anchor]
    retried = [
        "finetune-isear",
        "stats-dair_emotion-gram",
        "merge-simple-plain",
        *(f"match-{n}-L01.ffn" for n in others),
    ]
    runs = task_runs(state.state_details.flow_run_id, expect=[*retried, "finetune-meld", "report-t"])
    for name in retried:
        assert runs[name].run_count == 2, name  # failed once (transient), retried, completed
        assert runs[name].state.is_completed()
    assert runs["finetune-meld"].run_count == 1
    store = ArtifactStore(config.resolved_store_root())
    # the OOM retry halved the micro-batch (and doubled accumulation): same effective batch
    assert store.manifest(layout.model_key("t", "isear"))["meta"]["micro_batch"] == 8
    assert store.manifest(layout.model_key("t", "meld"))["meta"]["micro_batch"] == 16
    # one match task per module per non-anchor model
    n_modules = 4  # 2 layers x (attn, ffn)
    assert sum(1 for n in runs if n.startswith("match-")) == 2 * n_modules
    assert not any(n.startswith(f"match-{anchor}-") for n in runs)
    assert calls.counts["match_module"] == 2 * n_modules
    assert calls.counts["finetune_model"] == 3
    # 3 strategies x {plain, matched}, evaluated with the 3 fine-tuned models on 3 in-domain + 1 OOD set
    assert set(result["merged"]) == {f"{s}-{v}" for s in ("simple", "fisher", "regmean") for v in ("plain", "matched")}
    assert len(result["evaluations"]) == (6 + 3) * 4
    folder = store.local_cache(result["report"])
    text = (folder / "report.md").read_text()
    for name in ("simple", "fisher", "regmean", "goemotions_ekman", "before / after matching", "Timings",
                 "match_module"):  # fmt: skip
        assert name in text
    # the findings: a verdict on matching, matched minus plain per strategy, merges against the individual models
    assert "## Did matching change anything?" in text
    assert ("**Matching was a no-op**" in text) != ("Matching moved the weights:" in text)
    assert "## Matched minus plain" in text and "| regmean | " in text
    assert "## Merges against the individual models" in text and "Best individual out of domain:" in text
    assert "Merges that beat the best individual out of domain:" in text
    assert (folder / "metrics.csv").stat().st_size > 0 and (folder / "metrics.png").exists()
    # the report opens with symfuse inspect's verdict on the models: fine-tunes of one base share a basin
    assert text.split("\n## ")[1].startswith("Will these models merge?")
    inspection = store.get_json(layout.inspect_key("t"))
    assert inspection["verdict"] == "same-basin" and f"**Verdict: same-basin** — {inspection['reason']}" in text
    assert inspection["anchor"] == anchor and sorted(p["model"] for p in inspection["pairs"]) == sorted(others)
    assert all(p["total"]["before"] > 0 for p in inspection["pairs"])
    record = store.get_json(layout.eval_key("t", "regmean-matched", "goemotions_ekman"))
    # out of domain, every per-dataset head sharing a class with the set votes (evaluation.ood_heads: vote)
    assert record["domain"] == "out" and sorted(record["head"].split("+")) == sorted(config.dataset_names)
    assert len(record["metrics"]["heads"]) == 3


def test_library_lines_reach_the_run_logs(first_run):
    _, state, _ = first_run
    lines = run_logs(state.state_details.flow_run_id, expect="gram statistics: batch")
    # the library's INFO lines (symfuse.*), the retry policy's (tasks.*), progress of each stage
    assert any(line.startswith("symfuse.train.finetune: epoch 1: train loss") for line in lines), lines[:20]
    assert any(line.startswith("symfuse.stats.collect: gram statistics: batch") for line in lines)
    assert any(line.startswith("symfuse.evaluate.evaluate: evaluate on") for line in lines)
    assert any(line.startswith("tasks.policy: after out-of-memory: micro-batch 16 -> 8") for line in lines)
    assert any("taking run lock symfuse-run-t" in line for line in lines)
    assert not any("running in a worker thread" in line for line in lines)  # one notice per run, not per task


def test_ui_artifacts_render_without_the_store(first_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    config, state, _ = first_run
    with get_client(sync_client=True) as client:
        flt = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        artifacts = client.read_artifacts(artifact_filter=flt)
    by_type = {}
    for a in artifacts:
        by_type.setdefault(a.type, []).append(a)
    images = {a.key: a.data for a in by_type["image"]}
    assert images and all(d.startswith("data:image/png;base64,") for d in images.values()), list(images)
    assert "t-plot-metrics" in images  # one key per artifact kind: the metrics table keeps its own
    (table,) = [a for a in by_type["table"] if a.key == "t-metrics"]
    assert {"strategy", "variant"} <= set(table.data[0] if isinstance(table.data, list) else json.loads(table.data)[0])
    report_md = next(a.data for a in by_type["markdown"] if a.key == "t-report")
    assert "](metrics.png)" not in report_md and "![metrics](data:image/png;base64," in report_md
    merged_md = next(a.data for a in by_type["markdown"] if a.key == "t-merged-models")
    uri = state.result()["merged"]["regmean-matched"]
    assert f"`{uri}`" in merged_md and "t-card-regmean-matched" in merged_md  # a URI to copy, not a dead file:// link
    # one progress artifact per stage (not one per task), each naming its tasks, all ended at 100 %
    progress = {a.description.split(":")[0]: a for a in by_type["progress"]}
    assert len(progress) == len(by_type["progress"]), progress
    assert {"finetune", "stats", "eval", "merge"} <= set(progress), progress
    assert all(a.data == 100 for a in by_type["progress"])
    assert "isear 100 %" in progress["finetune"].description and "meld 100 %" in progress["finetune"].description
    # the model card, rendered in the UI; its inputs are store URIs, not the worker's deleted scratch folders
    store = ArtifactStore(config.resolved_store_root())
    card = (store.local_cache(uri) / "README.md").read_text()
    assert card.startswith("---\n") and "strategy: regmean" in card and "symmetry-matched" in card
    shown = next(a.data for a in by_type["markdown"] if a.key == "t-card-regmean-matched")
    assert "strategy: regmean" in shown and uri in shown
    plain = (store.local_cache(state.result()["merged"]["regmean-plain"]) / "README.md").read_text()
    assert store.uri(layout.model_key("t", "isear")) in plain
    inputs = [read_front_matter(c)["symfuse"]["inputs"] for c in (card, plain)]
    assert all(i.startswith("memory://") for i in inputs[0] + inputs[1]), inputs


def test_second_run_recomputes_nothing(first_run, monkeypatch):
    config, state, _ = first_run
    store = ArtifactStore(config.resolved_store_root())
    before = {k: store.manifest(k) for k in store.list(layout.run_prefix("t"))}
    # what a killed upload of an earlier run left: a version no manifest names, older than the grace period
    orphan = store._path(layout.model_key("t", "isear"), ".v", "20200101T000000000Z-0123456789abcdef", "model.bin")
    store.fs.pipe_file(orphan, b"half an upload")
    monkeypatch.setenv("SYMFUSE_STORE_GC_GRACE", "0")  # its file is new: past the grace period only with 0
    calls = Calls(monkeypatch)
    again = fusion_pipeline(config, return_state=True)
    assert again.is_completed(), again.message
    assert not store.fs.exists(orphan)  # collected at the start of the run
    assert calls.total() == 0, calls.counts
    assert {k: store.manifest(k) for k in store.list(layout.run_prefix("t"))} == before
    assert again.result()["report"] == state.result()["report"]
    lines = run_logs(again.state_details.flow_run_id, expect="reused stored report")
    uri = store.uri(layout.model_key("t", "isear"))
    assert any(f"reused stored fine-tuned model isear at {uri} (key " in line for line in lines), lines[:20]
    assert sum("reused stored" in line for line in lines) >= 3 + 6 + 9 * 4  # models, merges, evaluations at least
    runs = task_runs(again.state_details.flow_run_id, expect=["finetune-isear", "merge-simple-plain"])
    for name in ("finetune-isear", "merge-simple-plain"):  # reused work reads Cached in the UI (a Completed state)
        assert runs[name].state.name == "Cached" and runs[name].state.is_completed(), runs[name].state


def test_deterministic_error_fails_without_retry(nan_base, memory_root, monkeypatch):
    # weights are read by the fine-tune, not by the checks before the run: the task fails, once
    datasets = [{"name": n, "max_train_examples": 8} for n in ("meld", "isear")]
    config = tiny_config(nan_base, memory_root, datasets=datasets, strategies=["simple"], anchor="closest")
    state = fusion_pipeline(config, return_state=True)
    assert state.is_failed()
    run = task_runs(state.state_details.flow_run_id, expect=["finetune-meld"])["finetune-meld"]
    assert run.state.is_failed() and run.run_count == 1  # no retry of a deterministic error
    assert "NaN" in run.state.message
    with pytest.raises(Exception) as err:
        state.result()
    assert "NaN" in str(err.value) and str(nan_base) in str(err.value)
    lines = run_logs(state.state_details.flow_run_id, expect="not retrying")
    assert any(line.startswith("tasks.policy: finetune-meld: deterministic error, not retrying") for line in lines)


def test_a_run_id_in_use_is_refused_after_the_wait(tiny_base, memory_root, monkeypatch):
    import flows.runtime
    from flows.runtime import run_lock

    monkeypatch.setattr(flows.runtime, "LOCK_WAIT_SECONDS", 2)
    config = tiny_config(tiny_base, memory_root, run_id="busy")
    calls = Calls(monkeypatch)
    held, done = threading.Event(), threading.Event()

    def other_run():  # another flow run (another thread: its own context) holds run_id "busy"
        with run_lock("busy"):
            held.set()
            done.wait(60)

    holder = threading.Thread(target=other_run)
    holder.start()
    try:
        assert held.wait(60)
        state = fusion_pipeline(config, return_state=True)
    finally:
        done.set()
        holder.join()
    assert state.is_failed()
    with pytest.raises(RuntimeError, match=r"run_id 'busy' is in use by another flow run .*symfuse-run-busy"):
        state.result()
    assert calls.total() == 0 and not ArtifactStore(memory_root).list(layout.run_prefix("busy"))
