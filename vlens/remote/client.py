"""The engine of ``vlens.connect``'s Session: a ``vlens serve`` server.

:class:`RemoteEngine` gives the Session's runner the same small interface a
local :class:`~vlens.engine.Engine` gives it (:class:`vlens.backend.EngineAPI`:
``info``, ``tokenizer``, ``lock``, ``hold_vectors``, ``generate``, ``stream``,
``rpc``, ...), over HTTP, so every Session method and widget works unchanged
on a connected session. ``vlens.connect`` (``vlens/_open.py``) makes the
Session; nothing here imports the session module.

A call is one POST: the requests (token ids, sampling settings, plans) and
the steering vectors they name go up in one frame; per-step outputs (when
streaming) and finally the outputs with the call's records come back as
frames. The server keeps nothing of the call afterwards, so the runner's
``vlens_collect`` is answered from what the call brought back.
"""

from __future__ import annotations

import json
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vlens.checks import REMOTE_EDIT
from vlens.edits import vector_id
from vlens.errors import ClosedError, EngineError, VlensError
from vlens.methods.sae import SAE
from vlens.models import toychat_path, toyworld_path
from vlens.protocol.features import FeatureSpec
from vlens.protocol.tensors import decode_tensor, encode_tensor
from vlens.remote.wire import (FRAME_TYPE, FrameReader, merge_delta, output_from_wire, pack,
                               params_to_wire, settings_to_wire, unpack_one)

__all__ = ["RemoteEngine", "connected_copy"]


#: the live connections by their ``model`` (``URL/FOLDER``), for LogitLens
_CONNECTED: weakref.WeakValueDictionary[str, RemoteEngine] = weakref.WeakValueDictionary()


class ServerGone(VlensError):
    """The server did not answer (stopped, restarted, unreachable)."""


class RemoteEngine:
    """The runner's engine interface (:class:`vlens.backend.EngineAPI`),
    answered by a ``vlens serve`` server."""

    remote = True
    in_process = False
    compiled = False
    info: dict[str, Any]
    tokenizer: Any
    lock: Any
    model: str
    generate_calls: int

    def __init__(self, url: str, token: str, *, timeout: float = 30.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout, read=None), trust_env=False)
        self._closed = False
        self.lock = threading.RLock()
        self.generate_calls = 0
        self._held: dict[str, Any] = {}  # vectors the running call names
        self._collected: dict[str, list] = {}  # records the last call brought back
        about = self._json("GET", "/v1/info")
        self.info: dict[str, Any] = about["model"]
        self.limits: dict[str, int] = about["limits"]
        self.server = about["server"]
        self.model_name = about["model_name"]
        self.model = f"{self.url}/{self.model_name}"
        self.saes: dict[str, dict[str, Any]] = about.get("saes", {})  # the server's, by name
        self.vectors: dict[str, int] = about.get("vectors", {})
        self._sae_cache: dict[str, Any] = {}
        self.tokenizer = self._load_tokenizer()
        _CONNECTED[self.model] = self

    def local_copy(self) -> Path:
        """The folder of this server's model when it is one of the models
        bundled with vlens (same folder name and shape), for what reads the
        checkpoint itself (``LogitLens.from_pretrained(s.model)``)."""
        for bundled in (toyworld_path, toychat_path):
            try:
                folder = bundled()
                cfg = json.loads((folder / "config.json").read_text())
            except (FileNotFoundError, ValueError):
                continue
            if folder.name == self.model_name and (
                    cfg.get("num_hidden_layers"), cfg.get("hidden_size")) == (
                    self.info.get("n_layers"), self.info.get("hidden_size")):
                return folder
        raise VlensError(
            f"the server's model {self.model_name!r} stays on the server, so its weights "
            "cannot be read here: on a connected session use the worker's logit lens, "
            "s.trace(..., logit_lens=k)")

    # -- HTTP --------------------------------------------------------------------
    def _send(self, method: str, path: str, **kw: Any):
        import httpx

        self.check_open()
        try:
            return self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise self._gone(exc) from None

    def _gone(self, exc: Exception) -> ServerGone:
        return ServerGone(
            f"the vlens server at {self.url} is not answering ({type(exc).__name__}: {exc}). "
            "It may have stopped or restarted: ask whoever runs it, then "
            "s = vlens.connect(url, token=...) again")

    @staticmethod
    def _raise_for(resp: Any) -> None:
        if resp.status_code < 400:
            return
        try:
            message = resp.json().get("error") or resp.json().get("detail")
            if isinstance(message, dict):  # the OpenAI routes' error shape
                message = message.get("message")
        except ValueError:
            message = resp.text[:500]
        if resp.status_code == 401:
            raise VlensError(f"the server refused the token: {message}")
        raise VlensError(f"the server refused this call ({resp.status_code}): {message}")

    def _json(self, method: str, path: str) -> Any:
        resp = self._send(method, path)
        self._raise_for(resp)
        return resp.json()

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        resp = self._send("GET", "/v1/tokenizer")
        self._raise_for(resp)
        files = unpack_one(resp.content)["files"]
        with tempfile.TemporaryDirectory(prefix="vlens-tok-") as tmp:
            for name, data in files.items():
                if "/" in name or name.startswith("."):
                    raise VlensError(f"the server sent an odd tokenizer file name {name!r}")
                (Path(tmp) / name).write_bytes(data)
            return AutoTokenizer.from_pretrained(tmp)

    # -- the engine interface ----------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("this connection is closed; vlens.connect(url) again")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._http.close()

    @contextmanager
    def hold_vectors(self, vectors: Mapping[str, Any]) -> Iterator[None]:
        """The vectors travel with the call itself (the server caches them)."""
        self._held.update({vid: encode_tensor(v) for vid, v in vectors.items()})
        try:
            yield
        finally:
            for vid in vectors:
                self._held.pop(vid, None)

    def hold_saes(self, payloads: Mapping[str, Any], *, owner: Any = None) -> None:
        """The server holds its own SAEs; a plan may name only those."""
        served = {s["id"]: name for name, s in self.saes.items()}
        for sid in payloads:
            if sid not in served:
                raise VlensError(
                    "this SAE is not one the server loaded, and SAEs do not cross the wire: "
                    f"use the server's, s.sae(name) (it has {sorted(self.saes) or 'none'}; "
                    "vlens serve --sae NAME=PATH loads more)")

    def release_saes(self, ids: Iterable[str], *, owner: Any = None) -> None:
        """Nothing to release: the server's SAEs are its own, held for all its clients."""

    def sae(self, name: str) -> Any:
        """The server's SAE ``name``, rebuilt here from its weights (fetched once)."""
        if name in self._sae_cache:
            return self._sae_cache[name]
        if name not in self.saes:
            raise VlensError(f"the server has no SAE named {name!r}; it has "
                             f"{sorted(self.saes) or 'none'} (vlens serve --sae NAME=PATH)")
        resp = self._send("GET", f"/v1/saes/{name}")
        self._raise_for(resp)
        got = unpack_one(resp.content)
        sae = SAE({k: decode_tensor(w) for k, w in got["weights"].items()},
                  FeatureSpec.from_wire(got["spec"]), got["site"], int(got["layer"]), name=name)
        if sae.id != self.saes[name]["id"]:
            raise VlensError(f"the server's SAE {name!r} arrived changed: connect again")
        self._sae_cache[name] = sae
        return sae

    def register_vector(self, name: str, vector: Any) -> int:
        """Keep ``vector`` on the server as ``name``, for this token's calls only."""
        import torch

        if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or (
                not vector.is_floating_point()):
            raise VlensError("register_vector takes a 1-D floating-point torch.Tensor [width]")
        v = vector.detach().to("cpu", torch.float32).contiguous()
        if not bool(torch.isfinite(v).all()):
            raise VlensError("the vector holds NaN or inf")
        resp = self._send("POST", "/v1/vectors", headers={"Content-Type": FRAME_TYPE},
                          content=pack({"name": name,
                                        "vector": {"id": vector_id(v), **encode_tensor(v)}}))
        self._raise_for(resp)
        return int(resp.json()["your_vectors"])

    def register_preset(self, name: str, body: dict[str, Any]) -> int:
        """Keep ``body`` (a ``vlens`` object) as preset ``name`` for this
        token's calls under ``/presets/NAME/v1``."""
        resp = self._send("POST", "/v1/presets", json={"name": name, "vlens": body})
        self._raise_for(resp)
        return int(resp.json()["your_presets"])

    def cancel(self, owner: Any, error: BaseException) -> int:
        """Nothing to abort here: a connection's calls end with their HTTP
        stream (closing a Session closes no one else's connection)."""
        return 0

    def rpc(self, method: str, *args: Any) -> list[Any]:
        if method == "vlens_collect":
            return [{tag: self._collected.pop(tag, []) for tag in args[0]}]
        if method == "vlens_drop":
            for tag in args[0] or list(self._collected):
                self._collected.pop(tag, None)
            return [0]
        if method == "vlens_status":
            return [self._json("GET", "/v1/status")]
        if method == "vlens_put_edits":
            raise VlensError(REMOTE_EDIT)
        raise VlensError(f"{method} is not available on a connected session")

    def request_params(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """A request's sampling settings as they cross to the server, made
        without vLLM: the server checks them and makes the SamplingParams."""
        return settings_to_wire(settings)

    def _logprob_bytes(self, prompt: Any, sp: dict[str, Any]) -> int:
        """What one request's log-probabilities count against the server's
        read limit (vLLM works them out over the whole vocabulary for every
        row that asks: each prompt row, each generated one), as the server
        counts them (``vlens.remote.guard.check_call``)."""
        rows = (len(prompt["prompt_token_ids"]) if sp.get("prompt_logprobs") is not None
                else 0) + ((sp.get("n") or 1) * (sp.get("max_tokens") or 16)
                           if sp.get("logprobs") is not None else 0)
        return 4 * int(self.info.get("vocab_size") or 0) * rows

    def _slices(self, prompts: list[Any], params: list[Any]
                ) -> list[tuple[int, int, dict[str, Any]]]:
        """One call as consecutive ``(start, stop, vectors)`` slices that each
        fit the server's per-call limits on requests, steering vectors and
        the log-probabilities' share of its read limit (a patching grid or a
        head sweep can hold thousands of requests; the losses of a batch of
        prompts on a real model ask for log-probabilities over its whole
        vocabulary at every prompt token): the server then answers them one
        after another, as one call."""
        most = int(self.limits.get("requests") or len(prompts) or 1)
        most_vectors = int(self.limits.get("vectors") or len(self._held) or 1)
        most_bytes = int(self.limits.get("read_bytes") or 0)  # 0: not counted
        costs = ([self._logprob_bytes(p, sp) for p, sp in zip(prompts, params)] if most_bytes
                 else [0] * len(params))
        if (len(prompts) <= most and len(self._held) <= most_vectors
                and (not most_bytes or sum(costs) <= most_bytes)):
            return [(0, len(prompts), dict(self._held))]
        slices: list[tuple[int, int, dict[str, Any]]] = []
        start, named, spent = 0, set(), 0
        for i, sp in enumerate(params):
            needs = set(_held_names(sp.get("extra_args"), self._held))
            if i > start and (i - start >= most or len(named | needs) > most_vectors
                              or (most_bytes and spent + costs[i] > most_bytes)):
                slices.append((start, i, {v: self._held[v] for v in named}))
                start, named, spent = i, set(), 0
            named |= needs
            spent += costs[i]
        slices.append((start, len(params), {v: self._held[v] for v in named}))
        return slices

    def _frames(self, prompts: list[dict[str, Any]], params: list[Any],
                stream: bool, vectors: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST one call; yield its frames as they arrive. Closing this
        generator early closes the connection, and the server then aborts
        the call's requests and drops its records."""
        import httpx

        self.check_open()
        self.generate_calls += 1
        body = pack({
            "requests": [{"ids": list(p["prompt_token_ids"]), "params": sp}
                         for p, sp in zip(prompts, params)],
            "vectors": vectors,
            "stream": stream,
        })
        reader = FrameReader()
        try:
            with self._http.stream("POST", "/v1/generate", content=body,
                                   headers={"Content-Type": FRAME_TYPE}) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    self._raise_for(resp)
                for chunk in resp.iter_raw():
                    for frame in reader.feed(chunk):
                        if frame.get("kind") == "error":
                            raise EngineError(f"the server's engine failed this call: "
                                              f"{frame.get('message')}")
                        yield frame
        except httpx.TransportError as exc:
            raise self._gone(exc) from None
        if reader.pending:
            raise ServerGone(f"the vlens server at {self.url} stopped mid-answer; "
                             "vlens.connect(url, token=...) again once it is back")

    def _no_results(self) -> ServerGone:
        return ServerGone(f"the vlens server at {self.url} ended the call without results")

    def generate(self, prompts: list[Any], params: list[Any], progress: Any = None, *,
                 owner: Any = None) -> list[Any]:
        params = [_as_wire(sp) for sp in params]
        bar = progress(total=len(prompts)) if progress else None
        outputs: list[Any] = []
        records: dict[str, list] = {}
        try:
            for start, stop, vectors in self._slices(prompts, params):
                frames = self._frames(prompts[start:stop], params[start:stop],
                                      bar is not None, vectors)
                done = 0
                try:
                    for frame in frames:
                        if frame["kind"] == "done":
                            records.update(frame["records"])
                            outputs += [output_from_wire(o) for o in frame["outputs"]]
                            break
                        now = sum(1 for o in frame["outputs"] if o is not None and o["finished"])
                        if bar is not None and now > done:
                            bar.update(now - done)
                            done = now
                    else:
                        raise self._no_results()
                finally:
                    frames.close()
        finally:
            if bar is not None:
                bar.close()
        self._collected = records
        return outputs

    def stream(self, prompts: list[Any], params: list[Any], *,
               owner: Any = None) -> Iterator[list[Any]]:
        params = [_as_wire(sp) for sp in params]
        finished: list[Any] = []  # the outputs of the slices already answered
        records: dict[str, list] = {}
        for start, stop, vectors in self._slices(prompts, params):
            frames = self._frames(prompts[start:stop], params[start:stop], True, vectors)
            have: list[dict[str, Any] | None] = [None] * (stop - start)
            later = [None] * (len(prompts) - stop)
            try:
                for frame in frames:
                    if frame["kind"] == "done":
                        records.update(frame["records"])
                        finished += [output_from_wire(o) for o in frame["outputs"]]
                        break
                    have = [merge_delta(h, o) for h, o in zip(have, frame["outputs"], strict=True)]
                    yield finished + [output_from_wire(o) for o in have] + later
                else:
                    raise self._no_results()
            finally:
                frames.close()
        self._collected = records
        yield finished


def _held_names(value: Any, held: Mapping[str, Any]) -> Iterator[str]:
    """The held vectors' ids that a request's wire plan names, anywhere in it."""
    if isinstance(value, str):
        if value in held:
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _held_names(item, held)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _held_names(item, held)


def connected_copy(model: str) -> Path:
    """The local folder of a live connection's model (``s.model`` of a
    connected session): see :meth:`RemoteEngine.local_copy`."""
    engine = _CONNECTED.get(model)
    if engine is None:
        raise VlensError(f"{model} is no live connection's model: vlens.connect to it first")
    return engine.local_copy()


def _as_wire(sp: Any) -> dict[str, Any]:
    """A request's params as the server takes them: the runner's wire dict
    as it is, a vLLM ``SamplingParams`` (a caller's own) through
    :func:`~vlens.remote.wire.params_to_wire`."""
    return sp if isinstance(sp, Mapping) else params_to_wire(sp)
