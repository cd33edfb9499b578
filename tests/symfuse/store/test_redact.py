"""No credential in any log at any level: botocore's DEBUG output against a real (moto) S3 server."""

from __future__ import annotations

import logging
import sys

from symfuse.redact import MASK, redact
from symfuse.store import ArtifactStore, install_log_redaction

SENTINELS = {
    "AWS_ACCESS_KEY_ID": "AKIASENTINELKEYID0001",
    "AWS_SECRET_ACCESS_KEY": "sentinel-secret-access-key-0123456789abcd",
    "AWS_SESSION_TOKEN": "sentinel-session-token-FwoGZXIvYXdzEJr0123456789",
}


def test_debug_logs_of_an_s3_run_hold_no_credential(s3_server, s3_bucket, tmp_path, monkeypatch, caplog, capsys):
    for name, value in {**SENTINELS, "AWS_ENDPOINT_URL": s3_server.endpoint_url}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    root = logging.getLogger()
    stderr = logging.StreamHandler(sys.stderr)  # what `symfuse -v` prints: basicConfig's handler on stderr
    stderr.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(stderr)
    caplog.set_level(logging.DEBUG)
    try:
        # skip_instance_cache: a cached s3fs instance would hold another test's credentials
        store = ArtifactStore(f"s3://{s3_bucket}/creds", cache_dir=tmp_path / "cache", skip_instance_cache=True)
        store.put_json("runs/r/x", {"ok": 1}, producer="t")
        assert store.get_json("runs/r/x") == {"ok": 1}
        assert store.exists("runs/r/x") and not store.exists("runs/r/none")
        logging.getLogger("botocore.endpoint").debug("replayed header %s", {"X-Amz-Security-Token": b"tok0123456"})
    finally:
        root.removeHandler(stderr)
    err = capsys.readouterr().err
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records) + err
    assert "X-Amz-Security-Token" in logged and "Credential=" in logged  # the signed requests were logged...
    for name, value in SENTINELS.items():  # ...with every credential masked
        assert value not in logged, f"{name} leaked into the logs"
    assert MASK in err and MASK in caplog.text
    assert "tok0123456" not in logged


def test_filter_covers_child_loggers_and_handlers_added_later(monkeypatch, caplog):
    monkeypatch.setenv("AWS_SESSION_TOKEN", "late-token-0123456789")
    install_log_redaction("option-secret-0123456789")
    child = logging.getLogger("aiobotocore.some.new.module")  # created after installation
    caplog.set_level(logging.DEBUG)
    try:
        raise RuntimeError("bad token late-token-0123456789")
    except RuntimeError:
        child.debug("opts %s", {"secret": "option-secret-0123456789"}, exc_info=True)
    text = caplog.text
    assert "late-token-0123456789" not in text and "option-secret-0123456789" not in text
    assert "RuntimeError: bad token [REDACTED]" in text


def test_redact_patterns():
    headers = (
        "headers={'X-Amz-Security-Token': b'IQoJb3JpZ2luX2VjEJr', 'Authorization': b'AWS4-HMAC-SHA256 "
        "Credential=ASIAXXXXXXXXXXXXXXXX/20261123/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=abc123'}"
    )
    clean = redact(headers)
    for secret in ("IQoJb3JpZ2luX2VjEJr", "ASIAXXXXXXXXXXXXXXXX", "abc123"):
        assert secret not in clean
    assert "SignedHeaders=host" in clean and clean.count(MASK) == 3
    assert redact(clean) == clean  # masking twice changes nothing
    assert redact("x-amz-security-token:tok\nhost:h") == f"x-amz-security-token:{MASK}\nhost:h"
    assert redact("aws_session_token=abc aws_secret_access_key = xyz") == (
        f"aws_session_token={MASK} aws_secret_access_key = {MASK}"
    )
    assert redact("?X-Amz-Credential=AK%2Fx&X-Amz-Signature=ff&X-Amz-Security-Token=zz") == (
        f"?X-Amz-Credential={MASK}&X-Amz-Signature={MASK}&X-Amz-Security-Token={MASK}"
    )
    assert redact("pad_token: [PAD], n_tokens=3") == "pad_token: [PAD], n_tokens=3"  # ordinary words stay
