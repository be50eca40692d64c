"""Every code block of docs/openai.md and docs/workshop.md runs as written.

Each page's blocks run in order in a folder of their own, as a reader
would paste them: ``bash`` blocks in bash (one that starts ``vlens serve``
in the background, as "a terminal of its own", and the test waits for the
server's /health), ``python`` blocks in this environment's Python, and a
``json`` block holding a ``vlens`` object is sent with a chat request. The
reader's environment has ``VLENS_TOKEN`` set to the first participant's
token once a block wrote the token file (the pages say so). A block marked
``<!-- docs-test: skip (why) -->`` is a file for another program (a
JupyterHub config); unlabelled blocks are output or proxy configs.

The time from ``vlens serve`` to a healthy server is printed and written to
test-artifacts/docs-startup.json: the figure the pages state.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("openai-clients")]

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/openai.md", "docs/workshop.md")
PORT = 8765  # the pages' own
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"<!-- docs-test: skip \((.+?)\) -->\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int
    skip: str | None


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip().splitlines()[-1:] or [""]
        skip = SKIP.search(before[0])
        out.append(Block(m.group(2), textwrap.dedent(m.group(3)), text[:m.start()].count("\n") + 1,
                         skip.group(1) if skip else None))
    return out


def test_the_pages_have_the_blocks_this_test_runs():
    for page in PAGES:
        found = blocks(page)
        run = [b for b in found if b.lang in ("bash", "python", "json") and not b.skip]
        assert len(run) >= 2, page
        assert any("vlens serve" in b.code for b in run), page
        for b in found:  # unlabelled: output or another program's config, never code
            assert b.lang in ("", "bash", "python", "json"), (page, b.line, b.lang)


def _token(folder: Path) -> str | None:
    for name in ("tokens", "tokens.txt"):
        path = folder / name
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[1]
    return None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_as_written(page, tmp_path):
    with socket.socket() as sock:
        if sock.connect_ex(("127.0.0.1", PORT)) == 0:
            pytest.fail(f"port {PORT}, the one the pages use, is taken on this machine")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1"}
    env.pop("VLENS_TOKEN", None)
    env.pop("VLENS_SERVER", None)
    servers: list[subprocess.Popen] = []
    ran = []
    try:
        for b in blocks(page):
            if b.skip or b.lang not in ("bash", "python", "json"):
                continue
            token = _token(tmp_path)
            if token:
                env["VLENS_TOKEN"] = token
            where = f"{page}:{b.line}"
            if b.lang == "json":
                body = json.loads(b.code)
                auth = {"Authorization": f"Bearer {token}"}
                url = f"http://127.0.0.1:{PORT}"
                model = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
                resp = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=120, json={
                    "model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Tell me a story."}], **body})
                assert resp.status_code == 200, (where, resp.text)
            elif b.lang == "bash" and "vlens serve" in b.code:
                log = tmp_path / f"serve-{b.line}.log"
                start = time.monotonic()
                proc = subprocess.Popen(["bash", "-c", b.code], cwd=tmp_path, env=env,
                                        stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                        start_new_session=True)
                servers.append(proc)
                while True:
                    assert proc.poll() is None, (where, log.read_text()[-3000:])
                    assert time.monotonic() - start < 600, (where, log.read_text()[-3000:])
                    try:
                        if httpx.get(f"http://127.0.0.1:{PORT}/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.5)
                seconds = time.monotonic() - start
                print(f"{where}: vlens serve healthy after {seconds:.1f} s")
                _record(page, b.line, seconds)
            else:
                cmd = (["bash", "-e", "-o", "pipefail", "-c", b.code] if b.lang == "bash"
                       else [sys.executable, "-c", b.code])
                out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                                     timeout=600)
                assert out.returncode == 0, (where, out.stdout[-2000:], out.stderr[-3000:])
            ran.append(where)
    finally:
        for proc in servers:
            _stop(proc)
    assert servers and len(ran) >= 3, ran


def _record(page: str, line: int, seconds: float) -> None:
    out = ROOT / "test-artifacts" / "docs-startup.json"
    out.parent.mkdir(exist_ok=True)
    got = json.loads(out.read_text()) if out.exists() else {}
    got[f"{page}:{line}"] = round(seconds, 1)
    out.write_text(json.dumps(got, indent=1) + "\n")
