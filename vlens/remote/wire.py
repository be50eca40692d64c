"""What crosses between ``vlens serve`` and ``vlens.connect``: frames of JSON
plus raw bytes, never pickle.

A frame is ``u64 length`` then ``u32 header length, u32 blob count``, the
JSON header, and each blob as ``u64 length`` + bytes. Every ``bytes`` value
in the data (a tensor's ``data``, a tokenizer file) travels as a blob and
the header holds ``{"$blob": i}`` in its place, so a tensor costs its raw
size and nothing is ever executed when a frame is read.

vLLM's ``RequestOutput`` crosses as a small dict (the server builds it,
its logprobs through :func:`logprobs_to_wire`) and comes back as :class:`RemoteOutput`, which has the attributes the
Session's runner reads (``outputs[i].token_ids``, ``.text``, ``.logprobs``,
``prompt_logprobs``...). ``SamplingParams`` crosses as a dict of the fields
in :data:`PARAM_FIELDS` only.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vlens.errors import VlensError

__all__ = ["FRAME_TYPE", "WireError", "pack", "unpack", "FrameReader", "PARAM_FIELDS",
           "params_to_wire", "settings_to_wire", "logprobs_to_wire", "output_from_wire",
           "merge_delta", "RemoteOutput", "RemoteCompletion", "Logprob"]

FRAME_TYPE = "application/x-vlens-frame"
_HEAD = struct.Struct("<II")
_LEN = struct.Struct("<Q")
_MAX_BLOBS = 1 << 20

# SamplingParams fields a remote call may set; anything else (logits
# processors, structured outputs, bad-words lists...) is refused
PARAM_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output",
    "skip_reading_prefix_cache", "extra_args", "logprob_token_ids",
)

# fields vLLM fills in itself (or that only shape how outputs are handed out)
_DERIVED = {"output_kind", "output_text_buffer_length", "skip_clone", "stream_interval",
            "flat_logprobs", "routed_experts_prompt_start", "trace_decode_token_ids",
            "prompt_logprob_start"}


class WireError(ValueError):
    """A frame that cannot be read (truncated, bad JSON, bad blob index)."""


def pack(obj: Any) -> bytes:
    """``obj`` (JSON data with ``bytes`` anywhere) -> one frame."""
    blobs: list[bytes] = []

    def enc(x: Any) -> Any:
        if isinstance(x, (bytes, bytearray, memoryview)):
            blobs.append(bytes(x))
            return {"$blob": len(blobs) - 1}
        if isinstance(x, dict):
            return {str(k): enc(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [enc(v) for v in x]
        return x

    head = json.dumps(enc(obj), separators=(",", ":")).encode()
    parts = [_HEAD.pack(len(head), len(blobs)), head]
    for b in blobs:
        parts += [_LEN.pack(len(b)), b]
    body = b"".join(parts)
    return _LEN.pack(len(body)) + body


def unpack(frame: bytes | memoryview, max_containers: int | None = None) -> Any:
    """One frame's body (without its leading length) -> the data.
    ``max_containers``: refuse a header with more lists and objects than
    this, counted before it is parsed (a body of millions of nested empty
    lists costs seconds to parse, and tells the server nothing)."""
    view = memoryview(frame)
    if len(view) < _HEAD.size:
        raise WireError("frame shorter than its header")
    head_len, n_blobs = _HEAD.unpack_from(view, 0)
    pos = _HEAD.size + head_len
    if pos > len(view) or n_blobs > _MAX_BLOBS:
        raise WireError("frame header names more bytes than the frame holds")
    raw_head = bytes(view[_HEAD.size:pos])
    if max_containers is not None and (
            raw_head.count(b"[") + raw_head.count(b"{") > max_containers):
        raise WireError(f"frame header holds over {max_containers} lists and objects")
    try:
        head = json.loads(raw_head)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"frame header is not JSON ({exc})") from None
    blobs = []
    for _ in range(n_blobs):
        if pos + _LEN.size > len(view):
            raise WireError("frame truncated inside its blobs")
        (n,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        if pos + n > len(view):
            raise WireError("frame truncated inside a blob")
        blobs.append(bytes(view[pos:pos + n]))
        pos += n
    if pos != len(view):
        raise WireError("frame has bytes after its last blob")

    def dec(x: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise WireError("frame nests deeper than 32 levels")
        if isinstance(x, dict):
            if len(x) == 1 and "$blob" in x:
                i = x["$blob"]
                if type(i) is not int or not 0 <= i < len(blobs):
                    raise WireError(f"frame names blob {i!r}, which it does not hold")
                return blobs[i]
            return {k: dec(v, depth + 1) for k, v in x.items()}
        if isinstance(x, list):
            return [dec(v, depth + 1) for v in x]
        return x

    return dec(head)


def unpack_one(data: bytes, max_containers: int | None = None) -> Any:
    """A whole request body (exactly one frame, its length included)."""
    if len(data) < _LEN.size:
        raise WireError("body shorter than a frame")
    (n,) = _LEN.unpack_from(data, 0)
    if n != len(data) - _LEN.size:
        raise WireError(f"frame says {n} bytes, body holds {len(data) - _LEN.size}")
    return unpack(memoryview(data)[_LEN.size:], max_containers)


class FrameReader:
    """Cuts a byte stream into frames: ``feed(chunk)`` returns the frames
    completed by it."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[Any]:
        self._buf += chunk
        out = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf, 0)
            if len(self._buf) < _LEN.size + n:
                break
            out.append(unpack(bytes(self._buf[_LEN.size:_LEN.size + n])))
            del self._buf[:_LEN.size + n]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


# vLLM's defaults for the sampling settings a Session call may name that do
# not cross the wire (tests/test_serve.py holds them to SamplingParams()'s)
OFF_WIRE_DEFAULTS = {"detokenize": True, "logit_bias": None, "allowed_token_ids": None,
                     "bad_words": []}


def _off_wire(name: str) -> VlensError:
    return VlensError(f"sampling setting {name}= cannot be used on a connected session "
                      f"(it does not cross the wire); allowed: {', '.join(PARAM_FIELDS)}")


def settings_to_wire(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A connected session's request settings (``SamplingParams``'s keywords)
    -> the whitelisted dict, made without vLLM (a connected kernel may have
    none, and importing it costs seconds): the server checks the values
    (:func:`vlens.remote.guard.check_params`) and makes the SamplingParams.
    A setting outside the list is refused unless it is None or vLLM's default."""
    out: dict[str, Any] = {}
    for name, value in settings.items():
        if name in PARAM_FIELDS:
            out[name] = value
        elif name not in OFF_WIRE_DEFAULTS or value not in (None, OFF_WIRE_DEFAULTS[name]):
            raise _off_wire(name)
    stop = out.get("stop")
    if stop is not None:  # a string or a sequence of them, as SamplingParams takes it
        out["stop"] = [stop] if isinstance(stop, str) else list(stop)
    for name in ("stop_token_ids", "logprob_token_ids"):  # numpy ints too; a float is refused
        if out.get(name) is not None:
            out[name] = [operator.index(t) for t in out[name]]
    return out


def params_to_wire(sp: Any) -> dict[str, Any]:
    """A vLLM ``SamplingParams`` -> its whitelisted fields. A setting outside
    the list that differs from vLLM's default is refused (it would be lost)."""
    from vllm import SamplingParams

    default = SamplingParams()
    for name in getattr(type(sp), "__struct_fields__", ()):
        if name in PARAM_FIELDS or name in _DERIVED or name.startswith("_"):
            continue
        if getattr(sp, name) != getattr(default, name):
            raise _off_wire(name)
    return settings_to_wire({name: getattr(sp, name) for name in PARAM_FIELDS})


@dataclass
class Logprob:
    logprob: float


@dataclass
class RemoteCompletion:
    """One sample of a request, as the runner reads vLLM's CompletionOutput."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None] | None
    finish_reason: str | None


@dataclass
class RemoteOutput:
    """One request's output, as the runner reads vLLM's RequestOutput."""

    outputs: list[RemoteCompletion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    finished: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)


def logprobs_to_wire(entries: Any) -> list[Any] | None:
    """vLLM's per-position logprob dicts -> ``[[token, logprob], ...]`` per
    position (None where vLLM has none)."""
    if entries is None:
        return None
    return [None if e is None else [[int(t), float(lp.logprob)] for t, lp in e.items()]
            for e in entries]


def _entries(raw: Any) -> list[dict[int, Logprob] | None] | None:
    if raw is None:
        return None
    return [None if e is None else {int(t): Logprob(float(lp)) for t, lp in e} for e in raw]


def merge_delta(have: dict[str, Any] | None, delta: dict[str, Any] | None
                ) -> dict[str, Any] | None:
    """A request's outputs so far (wire form) with a stream frame's delta
    added: the server streams each step's new tokens, text and logprobs
    only, never the whole output again."""
    if delta is None:
        return have
    if have is None or not delta.get("delta"):
        have = {"finished": False, "prompt_logprobs": None, "outputs": []}
    outs = {o["index"]: dict(o) for o in have["outputs"]}
    for d in delta["outputs"]:
        o = outs.get(d["index"])
        if o is None:
            outs[d["index"]] = {**d, "token_ids": list(d["token_ids"]),
                                "logprobs": None if d["logprobs"] is None else list(d["logprobs"])}
            continue
        o["text"] += d["text"]
        o["token_ids"] = o["token_ids"] + list(d["token_ids"])
        if d["logprobs"] is not None:
            o["logprobs"] = (o["logprobs"] or []) + list(d["logprobs"])
        o["finish_reason"] = d["finish_reason"]
    return {"finished": bool(delta["finished"]),
            "prompt_logprobs": delta["prompt_logprobs"] if delta["prompt_logprobs"] is not None
            else have["prompt_logprobs"],
            "outputs": [outs[k] for k in sorted(outs)]}


def output_from_wire(raw: dict[str, Any] | None) -> RemoteOutput | None:
    if raw is None:
        return None
    return RemoteOutput(
        outputs=[RemoteCompletion(int(c["index"]), c["text"], list(c["token_ids"]),
                                  _entries(c["logprobs"]), c["finish_reason"])
                 for c in raw["outputs"]],
        prompt_logprobs=_entries(raw["prompt_logprobs"]),
        finished=bool(raw["finished"]),
    )
