"""The server's small checks, without an engine: the token file, the
canonical plan form, the wire's blob indices, stream deltas, the host."""

from __future__ import annotations

import os

import pytest

from vlens.errors import VlensError


def _tokens(tmp_path, data: bytes, mode: int = 0o600):
    path = tmp_path / "tokens"
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_the_token_file_is_private_utf8_and_bom_free(tmp_path):
    from vlens.remote.tokens import load_tokens

    token = "a" * 20
    assert load_tokens(_tokens(tmp_path, f"p1 {token}\n".encode())) == {token: "p1"}
    # a byte-order mark is not part of the first name or token
    bom = _tokens(tmp_path, "\ufeffp1 {}\n".format(token).encode("utf-8"))
    assert load_tokens(bom) == {token: "p1"}
    for mode in (0o644, 0o620, 0o606):
        with pytest.raises(VlensError, match="other users .* chmod 600"):
            load_tokens(_tokens(tmp_path, f"p1 {token}\n".encode(), mode))
    with pytest.raises(VlensError, match="not UTF-8 text"):
        load_tokens(_tokens(tmp_path, b"p1 \xff\xfe" + b"x" * 20))


def test_plans_must_be_canonical_with_types_that_count():
    from vlens.remote.guard import _ID, _strict_equal

    assert _strict_equal({"layers": [1], "k": 0}, {"layers": [1], "k": 0})
    assert not _strict_equal({"layers": [True]}, {"layers": [1]})
    assert not _strict_equal({"scale": 1}, {"scale": 1.0})
    assert not _strict_equal([1, 2], [1, 2, 3])
    assert _ID.fullmatch("s0-1-2") and not _ID.fullmatch("s0-1-2\n")


def test_a_blob_index_is_an_int_not_a_bool():
    from vlens.remote.wire import WireError, pack, unpack_one

    frame = pack({"x": b"abc"})
    assert unpack_one(frame) == {"x": b"abc"}
    forged = pack({"x": {"$blob": True}, "y": b"abc"})  # one blob, named by True
    with pytest.raises(WireError, match="blob True"):
        unpack_one(forged)


def test_stream_deltas_rebuild_the_whole_output():
    from vlens.remote.wire import merge_delta

    steps = [
        {"finished": False, "prompt_logprobs": [None, [[3, -0.5]]], "delta": True,
         "outputs": [{"index": 0, "text": "the", "token_ids": [5], "logprobs": [[[5, -0.1]]],
                      "finish_reason": None}]},
        {"finished": False, "prompt_logprobs": None, "delta": True,
         "outputs": [{"index": 0, "text": " wind", "token_ids": [6],
                      "logprobs": [[[6, -0.2]]], "finish_reason": None},
                     {"index": 1, "text": "a", "token_ids": [9], "logprobs": None,
                      "finish_reason": None}]},
        {"finished": True, "prompt_logprobs": None, "delta": True,
         "outputs": [{"index": 0, "text": "", "token_ids": [], "logprobs": [],
                      "finish_reason": "length"}]},
    ]
    have = None
    for step in steps:
        have = merge_delta(have, step)
    assert have["finished"] and have["prompt_logprobs"] == [None, [[3, -0.5]]]
    first, second = have["outputs"]
    assert first["text"] == "the wind" and first["token_ids"] == [5, 6]
    assert first["logprobs"] == [[[5, -0.1]], [[6, -0.2]]] and first["finish_reason"] == "length"
    assert second["token_ids"] == [9]
    assert merge_delta(have, None) is have


def test_only_loopback_hosts_pass_without_a_warning():
    from vlens.remote.launch import is_loopback as _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("10.1.2.3")
    assert not _loopback("workshop.example.org")


def test_a_token_with_odd_characters_is_refused_without_showing_it():
    import vlens

    secret = "abc def-ghijklmnopqrstu"
    with pytest.raises(VlensError, match="spaces, control") as err:
        vlens.connect("http://127.0.0.1:9", token=secret)
    assert secret not in str(err.value)


def test_a_read_with_the_wrong_rows_fails_alone_when_the_step_log_is_cut():
    """One malformed read in a step (rows that do not match its spans, as a
    positions read through the logit lens gave) never cuts another
    request's rows: the step log skips it and the others are kept."""
    from types import SimpleNamespace

    import torch

    from vlens.worker.records import StepLog

    span = lambda key, a, b: SimpleNamespace(key=key, start=a, stop=b)  # noqa: E731
    good = SimpleNamespace(spans=(span("r1", 0, 2), span("r2", 2, 5)))
    bad = SimpleNamespace(spans=(span("r3", 5, 6), span("r4", 6, 8)))
    log = StepLog()
    log.put(("resid_post", "value", 0), torch.arange(10.0).reshape(5, 2), good)
    log.put(("positions:logit_lens", "ids", 0), torch.zeros(()), bad)  # a scalar: no rows
    n, reads, _ = log.of("r2")
    assert n == 3 and torch.equal(reads[("resid_post", "value", 0)], torch.arange(4.0, 10).reshape(3, 2))
    assert log.of("r3") == (0, {}, 0)


def test_vector_files_load_one_finite_1d_tensor_and_never_pickle(tmp_path):
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from vlens.remote.names import load_vector, parse_named

    v = torch.linspace(-1, 1, 12)
    save_file({"v": v}, str(tmp_path / "one.safetensors"))
    torch.save(v, tmp_path / "v.pt")
    np.save(tmp_path / "v.npy", v.numpy())
    for name in ("one.safetensors", "v.pt", "v.npy"):
        assert torch.equal(load_vector(tmp_path / name), v)
    save_file({"a": v, "b": v.clone()}, str(tmp_path / "two.safetensors"))
    with pytest.raises(VlensError, match="holds 2 tensors"):
        load_vector(tmp_path / "two.safetensors")
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(VlensError, match="could not be read"):  # allow_pickle=False
        load_vector(tmp_path / "obj.npy")
    torch.save({"code": print}, tmp_path / "obj.pt")
    with pytest.raises(VlensError, match="could not be read"):  # weights_only=True
        load_vector(tmp_path / "obj.pt")
    np.save(tmp_path / "m.npy", np.ones((2, 3), dtype=np.float32))
    with pytest.raises(VlensError, match="1-D"):
        load_vector(tmp_path / "m.npy")
    np.save(tmp_path / "nan.npy", np.array([1.0, np.nan], dtype=np.float32))
    with pytest.raises(VlensError, match="NaN"):
        load_vector(tmp_path / "nan.npy")
    assert parse_named(["a=x", "b.c=y=z"], "--vector") == {"a": "x", "b.c": "y=z"}
    for bad in (["a"], ["=x"], ["a b=x"], ["a=x", "a=y"]):
        with pytest.raises(VlensError, match="--vector"):
            parse_named(bad, "--vector")
