"""Downloads from a local HTTP server with Range support: resume, verify, refuse."""

from __future__ import annotations

import hashlib
import http.server
import threading

import pytest

from nmt.data.download import download
from nmt.data.recipes import Archive
from nmt.errors import DownloadError, IntegrityError

PAYLOAD = bytes(range(256)) * 2048  # 512 KiB


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves PAYLOAD at any path; honours Range; the first `cut_after` bytes of the first
    response are followed by a dropped connection."""

    cut_after: int | None = None
    ranges: list[str | None] = []

    def do_GET(self):
        header = self.headers.get("Range")
        type(self).ranges.append(header)
        start = int(header.split("=")[1].split("-")[0]) if header else 0
        body = PAYLOAD[start:]
        self.send_response(206 if header else 200)
        if header:
            self.send_header("Content-Range", f"bytes {start}-{len(PAYLOAD) - 1}/"
                                              f"{len(PAYLOAD)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = type(self).cut_after
        if cut is not None:
            type(self).cut_after = None
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Handler.ranges = []
    _Handler.cut_after = None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, _Handler
    httpd.shutdown()
    httpd.server_close()


def _archive(httpd, **checks):
    return Archive(id="x", url=f"http://127.0.0.1:{httpd.server_port}/files/data.tgz",
                   **checks)


def test_stopped_download_resumes_with_range(tmp_path, server):
    httpd, handler = server
    handler.cut_after = 100_000
    archive = _archive(httpd, sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD))
    dest = tmp_path / "data.tgz"
    with pytest.raises(DownloadError, match="failed after 100000 bytes.*run the same "
                       "command again to resume"):
        download(archive, dest, retries=1, timeout=5)
    assert not dest.exists()
    assert (tmp_path / "data.tgz.part").stat().st_size == 100_000
    local, checked = download(archive, dest, retries=1, timeout=5)
    assert handler.ranges == [None, "bytes=100000-"]
    assert dest.read_bytes() == PAYLOAD and local.path == dest
    assert checked == {"sha256": hashlib.sha256(PAYLOAD).hexdigest(), "size": len(PAYLOAD)}
    assert not (tmp_path / "data.tgz.part").exists()


def test_retries_resume_within_one_call(tmp_path, server):
    httpd, handler = server
    handler.cut_after = 12_345
    archive = _archive(httpd, md5=hashlib.md5(PAYLOAD).hexdigest())
    download(archive, tmp_path / "data.tgz", retries=3, timeout=5)
    assert handler.ranges == [None, "bytes=12345-"]
    assert (tmp_path / "data.tgz").read_bytes() == PAYLOAD


def test_checksum_mismatch_writes_nothing(tmp_path, server):
    httpd, _ = server
    archive = _archive(httpd, sha256="0" * 64)
    with pytest.raises(IntegrityError, match=r"data.tgz.part: sha256 mismatch \(expected "
                       "0000"):
        download(archive, tmp_path / "data.tgz", retries=1, timeout=5)
    assert list(tmp_path.iterdir()) == []


def test_http_error_is_download_error(tmp_path):
    archive = Archive(id="x", url="http://127.0.0.1:9/nothing.tgz")  # discard port: refused
    with pytest.raises(DownloadError, match="nothing.tgz failed"):
        download(archive, tmp_path / "nothing.tgz", retries=1, timeout=2)
