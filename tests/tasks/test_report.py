"""Report images the Prefect UI can show: relative links in report.md become data: URLs (or absolute store URIs)."""

from __future__ import annotations

import base64

from tasks import report as report_task
from tasks.report import absolute_images, image_url

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


def test_relative_images_are_embedded_and_the_rest_left_alone(tmp_path):
    (tmp_path / "metrics.png").write_bytes(PNG)
    text = "# r\n\n![metrics](metrics.png)\n\n![gone](missing.png) ![web](https://x.org/a.png) [csv](metrics.csv)\n"
    out = absolute_images(text, tmp_path, "s3://bucket/runs/r/report")
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert f"![metrics]({url})" in out
    assert base64.b64decode(url.split(",", 1)[1]) == PNG
    assert "![gone](missing.png)" in out and "![web](https://x.org/a.png)" in out and "[csv](metrics.csv)" in out


def test_a_large_image_is_linked_by_its_store_uri(tmp_path, monkeypatch):
    (tmp_path / "distances.png").write_bytes(PNG)
    monkeypatch.setattr(report_task, "INLINE_MAX_BYTES", 10)
    assert image_url(tmp_path / "distances.png", "file:///store/r/distances.png") == "file:///store/r/distances.png"
    out = absolute_images("![d](distances.png)", tmp_path, "file:///store/r")
    assert out == "![d](file:///store/r/distances.png)"
