"""``s.harvest``: every token's activations of many texts, to disk, in shards.

The rows on disk are the rows ``s.trace`` reads of the same texts in the
same batches, bit for bit (a shard's texts are traced together, so the
reference traces each shard's texts together too), under chunked prefill
(``llama_session``: 64-token steps) and under prefix caching and
preemption (``loaded_session``); an interrupted harvest, run again, ends
with the same shards (sha256) as one that never stopped; bad arguments are
VlensErrors that say what to do.
"""

from __future__ import annotations

import json

import pytest
import torch

import vlens
from vlens.models.registry import file_sha256

pytestmark = pytest.mark.engine


def _text(n_words: int, offset: int) -> str:
    return " ".join(f"w{(offset + 7 * i) % 240}" for i in range(n_words))


# 3 to 150 tokens: the long ones span several 64-token prefill steps
TEXTS = [_text(n, k) for k, n in enumerate([12, 90, 5, 30, 150, 3, 44, 70, 8, 61])]
LAYERS = [0, 2]
SITES = ["resid_post", "z"]


def _reference(s, h, texts):
    """Per (site, layer): ``s.trace`` of each shard's texts (one call, as the
    harvest made it), every token's rows in text order; and the ids."""
    rows = {(site, L): [] for site in h.sites for L in h.layers}
    ids = []
    for shard in h.shards:
        a, b = shard["texts"]
        run = s.trace(texts[a:b], layers=h.layers, sites=h.sites, max_new_tokens=1,
                      logprobs=False)
        for t in run:
            ids += t.token_ids
            for (site, L), got in rows.items():
                r = t.activations(site, layer=L)
                got.append(r.reshape(r.shape[0], -1))
    return {k: torch.cat(v) for k, v in rows.items()}, torch.tensor(ids)


def _check_equal(s, h, texts):
    ref, ids = _reference(s, h, texts)
    assert torch.equal(h.token_ids, ids)
    for (site, L), want in ref.items():
        got = h.read(site, L)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want), f"{site} layer {L}: max diff {(got - want).abs().max()}"


def test_a_harvest_is_the_trace_reads_bit_for_bit(llama_session, tmp_path):
    s = llama_session
    h = s.harvest(TEXTS, layers=LAYERS, sites=SITES, out=tmp_path / "h", shard_tokens=100)
    n = [len(s.tokenize(t)) for t in TEXTS]
    assert len(h) == sum(n) and h.complete
    assert h.spans[3] == (sum(n[:3]), sum(n[:4]))
    # whole texts per shard, each at least shard_tokens but the last
    assert [sh["texts"] for sh in h.shards] == [[0, 2], [2, 5], [5, 8], [8, 10]]
    assert all(sh["tokens"][1] - sh["tokens"][0] >= 100 for sh in h.shards[:-1])
    _check_equal(s, h, TEXTS)
    assert torch.equal(h.text_rows(4, "z", 2), h.read("z", 2)[slice(*h.spans[4])])
    assert h.read("z", 0).shape == (len(h), s.facts.width("z"))

    manifest = json.loads((tmp_path / "h" / "manifest.json").read_text())
    assert manifest["sites"] == SITES and manifest["layers"] == LAYERS
    assert manifest["dtype"] == "float32" and manifest["vlens"] == vlens.__version__
    assert manifest["model"] == str(s.model)
    assert [t["tokens"] for t in manifest["texts"]] == n
    for sh in manifest["shards"]:
        assert sh["sha256"] == file_sha256(tmp_path / "h" / sh["file"])
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == [
        "manifest.json", *(f"shard-0000{k}.safetensors" for k in range(4))]

    again = vlens.Harvest.open(tmp_path / "h")
    again.verify()
    assert len(again) == len(h) and torch.equal(again.read("resid_post", 2),
                                                h.read("resid_post", 2))
    assert "Harvest(" in repr(again) and "complete" in repr(again) and "4 shards" in repr(again)
    # a finished harvest, asked again: nothing rewritten, no engine call
    mtimes = [(tmp_path / "h" / sh["file"]).stat().st_mtime_ns for sh in h.shards]
    s.harvest(TEXTS, layers=LAYERS, sites=SITES, out=tmp_path / "h", shard_tokens=100)
    assert mtimes == [(tmp_path / "h" / sh["file"]).stat().st_mtime_ns for sh in h.shards]


def test_prefix_caching_and_preemption_change_nothing(loaded_session, tmp_path):
    """Prefill chunks of 32 tokens, prefix caching on, 6 KV blocks: texts
    sharing prefixes and repeated texts, long enough to be preempted."""
    s = loaded_session
    base = _text(100, 3)
    texts = [base, base + " w1 w2", base, _text(120, 5), _text(118, 9), base + " w7",
             _text(125, 2), _text(40, 1)]
    s.generate([base, base], max_new_tokens=2)  # the prefix is in the cache
    h = s.harvest(texts, layers=[1, 2], sites=["resid_post", "mlp_out"], out=tmp_path / "h",
                  shard_tokens=300)
    assert h.complete and len(h.shards) > 1
    _check_equal(s, h, texts)
    # the repeated text's rows are whole (none served from the prefix cache)
    assert torch.equal(h.text_rows(0, "resid_post", 2), h.text_rows(2, "resid_post", 2))


def test_an_interrupted_harvest_resumes_to_the_same_shards(llama_session, tmp_path):
    s = llama_session
    kw = dict(layers=LAYERS, sites=SITES, shard_tokens=60)
    whole = s.harvest(TEXTS, out=tmp_path / "whole", **kw)
    calls = []

    def stop(done, total):
        calls.append((done, total))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        s.harvest(TEXTS, out=tmp_path / "cut", progress=stop, **kw)
    assert calls == [(whole.shards[0]["tokens"][1], len(whole))]
    cut = vlens.Harvest.open(tmp_path / "cut")
    assert len(cut.shards) == 1 and not cut.complete and "of 10 texts done" in repr(cut)
    first = (tmp_path / "cut" / cut.shards[0]["file"]).stat().st_mtime_ns
    (tmp_path / "cut" / ".shard-00001.safetensors.tmp").write_bytes(b"half")  # an interrupt's
    seen = []
    done = s.harvest(TEXTS, out=tmp_path / "cut", progress=lambda d, t: seen.append(d), **kw)
    assert seen[0] > whole.shards[0]["tokens"][1] and seen[-1] == len(whole)
    assert (tmp_path / "cut" / cut.shards[0]["file"]).stat().st_mtime_ns == first
    assert [sh["sha256"] for sh in done.shards] == [sh["sha256"] for sh in whole.shards]
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir())
    # the same folder with other arguments is refused, not mixed
    with pytest.raises(vlens.VlensError, match=r"holds another harvest \(its layers"):
        s.harvest(TEXTS, out=tmp_path / "cut", layers=[1], sites=SITES, shard_tokens=60)


@pytest.mark.parametrize("kw, match", [
    (dict(sites=["nope"]), "nope"),
    (dict(layers=[7]), "layer"),
    (dict(texts=[]), "non-empty list of texts"),
    (dict(texts="one text"), r"pass \[text\]"),
    (dict(shard_tokens=0), "shard_tokens must be a positive int"),
    (dict(sites=["attn_pattern"]), "harvest 'z' or a residual site"),
    (dict(out=None), "out= must be a folder path"),
    (dict(progress="yes"), "progress must be"),
])
def test_bad_arguments_are_refused_with_the_fix(llama_session, tmp_path, kw, match):
    args = dict(texts=TEXTS[:2], layers=LAYERS, sites=["resid_post"], out=tmp_path / "h",
                shard_tokens=10)
    args.update(kw)
    with pytest.raises(vlens.VlensError, match=match):
        llama_session.harvest(args.pop("texts"), **args)
    assert not (tmp_path / "h" / "manifest.json").exists()


def test_a_folder_with_other_files_is_refused(llama_session, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(vlens.VlensError, match="holds files but no manifest.json"):
        llama_session.harvest(TEXTS[:2], layers=0, out=tmp_path, shard_tokens=10)
    with pytest.raises(vlens.VlensError, match="not a harvest folder"):
        vlens.Harvest.open(tmp_path)
