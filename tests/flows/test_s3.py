"""The pipeline over a moto S3 server on 127.0.0.1: every artifact lands in the bucket, manifests last."""

from __future__ import annotations

import json
import re

import boto3
import pytest

from flows.pipeline import fusion_pipeline
from tests.flows.conftest import tiny_config
from tests.integration.servers import moto_s3_server


@pytest.fixture(scope="module")
def s3():
    with moto_s3_server() as server:
        yield server


def test_pipeline_on_s3(s3, tiny_base, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    bucket = s3.make_bucket()
    config = tiny_config(
        tiny_base,
        f"s3://{bucket}/symfuse",
        datasets=[{"name": n, "max_train_examples": 16, "max_eval_examples": 16} for n in ("isear", "meld")],
        strategies=["simple", "regmean"],
        anchor="closest",
    )
    result = fusion_pipeline(config)
    assert result["report"] == f"s3://{bucket}/symfuse/runs/t/report"
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.key,
                          aws_secret_access_key=s3.secret, region_name=s3.region)  # fmt: skip
    objects = {
        o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page["Contents"]
    }
    keys = {re.sub(r"/\.v/[^/]+/", "/", k) for k in objects}  # data files lie in the artifact's version folder
    for rel in (
        "report/report.md",
        "report/metrics.csv",
        "report/manifest.json",
        "merged/regmean/matched/config.json",
        "merged/simple/plain/manifest.json",
        "models/isear/model.safetensors",
        "stats/meld/meld/gram/manifest.json",
    ):
        assert f"symfuse/runs/t/{rel}" in keys, rel
    # every artifact folder has its manifest
    folders = {k.rsplit("/", 1)[0] for k in keys}
    artifacts = {f for f in folders if f + "/manifest.json" in keys}
    assert len(artifacts) >= 2 + 2 + 4 + 4  # models, stats, transforms, merged (+ evals, report, ...)
    # every data object lies in the version its artifact's manifest names (no unpublished leftovers)
    published = {
        f"{k.rsplit('/', 1)[0]}/.v/{json.loads(client.get_object(Bucket=bucket, Key=k)['Body'].read())['version']}"
        for k in objects
        if k.endswith("/manifest.json")
    }
    for k in objects - {k for k in objects if k.endswith("/manifest.json")}:
        version = re.match(r"(.+/\.v/[^/]+)/", k)
        assert version is not None and version.group(1) in published, k
