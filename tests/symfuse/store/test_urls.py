"""Store URLs checked before any work: the scheme, and no credential inside the URL (it would reach the logs)."""

from __future__ import annotations

import pytest

from symfuse.errors import UsageError
from symfuse.redact import MASK, redact
from symfuse.store import ArtifactStore
from symfuse.store.urls import masked_url, store_url_problem

SECRET = "testSECRETvalue99"


@pytest.mark.parametrize(
    ("url", "start", "fix"),
    [
        (f"s3://AKIATESTKEY0000:{SECRET}@bucket/p", f"--store s3://{MASK}@bucket/p: credentials in the URL",
         "give s3://bucket/p and the credentials in AWS_ACCESS_KEY_ID"),
        (f"gs://user:{SECRET}@bucket", f"--store gs://{MASK}@bucket: credentials", "GOOGLE_APPLICATION_CREDENTIALS"),
        ("foo://bucket/p", "--store foo://bucket/p: unknown storage scheme 'foo'", "give a local folder"),
        ("abfs://container/p", "--store abfs://container/p: abfs:// cannot be opened here (", "install it"),
        # no bucket: the run passed its checks, started Prefect and failed at its first write
        ("s3://", "--store s3://: no bucket name after s3://", "give s3://bucket/prefix"),
        ("s3:///runs", "--store s3:///runs: no bucket name after s3://", "give s3://bucket/prefix"),
        # the host of a file URL was read as the first folder of a path in the working folder
        ("file://relative/store", "--store file://relative/store: 'relative' stands where a file URL names a host",
         "give file:///<absolute path>, or a plain path"),
        # passed (the check lower-cased it), then "Protocol not known: S3" once Prefect had started
        ("S3://b/p", "--store S3://b/p: write the scheme in lower case", "— s3://b/p"),
        (f"S3://k:{SECRET}@b/p", f"--store S3://{MASK}@b/p: write the scheme in lower case", f"— s3://{MASK}@b/p"),
    ],
)  # fmt: skip
def test_bad_store_urls_are_one_line_without_the_secret(url, start, fix):
    problem = store_url_problem(url, "--store")
    assert problem is not None and problem.startswith(start) and fix in problem and SECRET not in problem, problem
    with pytest.raises(UsageError) as info:
        ArtifactStore(url)
    assert str(info.value) == problem.replace("--store", "store root", 1)  # before any backend is reached


def test_good_urls_and_paths_pass(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    for root in ("s3://bucket/prefix", "memory://x", f"file://{tmp_path}", str(tmp_path), "relative/dir", "a@b/c"):
        assert store_url_problem(root, "--store") is None, root


def test_an_endpoint_variable_holding_a_credential_is_refused_masked(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://user:{SECRET}@127.0.0.1:9")
    problem = store_url_problem("s3://bucket/p", "--store")
    assert problem == (
        f"$AWS_ENDPOINT_URL http://{MASK}@127.0.0.1:9: credentials in the endpoint URL are not read (and would be "
        "written to logs) — set it without user:password@ and give the credentials in AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    )


def test_redaction_masks_the_user_part_of_any_url():
    text = f"s3://AKIATESTKEY0000:{SECRET}@bucket/p failed; see http://u:{SECRET}@host:9/x and git@github.com:o/r"
    assert redact(text) == f"s3://{MASK}@bucket/p failed; see http://{MASK}@host:9/x and git@github.com:o/r"
    assert redact(redact(text)) == redact(text)
    assert masked_url(f"s3://k:{SECRET}@b/p") == f"s3://{MASK}@b/p" and masked_url("s3://b/p@x") == "s3://b/p@x"
