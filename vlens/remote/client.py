"""``vlens.connect``: a Session whose engine is a ``vlens serve`` server.

:class:`RemoteEngine` gives the Session's runner the same small interface a
local :class:`~vlens.engine.Engine` gives it (``info``, ``tokenizer``,
``lock``, ``hold_vectors``, ``generate``, ``stream``, ``rpc``), over HTTP, so
every Session method and widget works unchanged on a connected session.

A call is one POST: the requests (token ids, sampling settings, plans) and
the steering vectors they name go up in one frame; per-step outputs (when
streaming) and finally the outputs with the call's records come back as
frames. The server keeps nothing of the call afterwards, so the runner's
``vlens_collect`` is answered from what the call brought back.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vlens.protocol.tensors import encode_tensor
from vlens.checks import REMOTE_EDIT
from vlens.errors import ClosedError, EngineError, VlensError

__all__ = ["RemoteEngine", "connect"]


class ServerGone(VlensError):
    """The server did not answer (stopped, restarted, unreachable)."""


class RemoteEngine:
    """The runner's engine interface, answered by a ``vlens serve`` server."""

    remote = True
    in_process = False
    compiled = False

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
        self.model = f"{self.url}/{about['model_name']}"
        self.saes: dict[str, dict[str, Any]] = about.get("saes", {})  # the server's, by name
        self.vectors: dict[str, int] = about.get("vectors", {})
        self._sae_cache: dict[str, Any] = {}
        self.tokenizer = self._load_tokenizer()

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

        from vlens.remote.wire import unpack_one

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

    def hold_saes(self, payloads: Mapping[str, Any]) -> None:
        """The server holds its own SAEs; a plan may name only those."""
        served = {s["id"]: name for name, s in self.saes.items()}
        for sid in payloads:
            if sid not in served:
                raise VlensError(
                    "this SAE is not one the server loaded, and SAEs do not cross the wire: "
                    f"use the server's, s.sae(name) (it has {sorted(self.saes) or 'none'}; "
                    "vlens serve --sae NAME=PATH loads more)")

    def sae(self, name: str) -> Any:
        """The server's SAE ``name``, rebuilt here from its weights (fetched once)."""
        from vlens.methods.sae import SAE
        from vlens.protocol.features import FeatureSpec
        from vlens.protocol.tensors import decode_tensor
        from vlens.remote.wire import unpack_one

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

        from vlens.edits import vector_id
        from vlens.remote.wire import FRAME_TYPE, pack

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

    def _frames(self, prompts: list[dict[str, Any]], params: list[Any],
                stream: bool) -> Iterator[dict[str, Any]]:
        """POST one call; yield its frames as they arrive. Closing this
        generator early closes the connection, and the server then aborts
        the call's requests and drops its records."""
        import httpx

        from vlens.remote.wire import FRAME_TYPE, FrameReader, pack, params_to_wire

        self.check_open()
        self.generate_calls += 1
        body = pack({
            "requests": [{"ids": list(p["prompt_token_ids"]), "params": params_to_wire(sp)}
                         for p, sp in zip(prompts, params)],
            "vectors": dict(self._held),
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

    def _done(self, frame: dict[str, Any]) -> list[Any]:
        from vlens.remote.wire import output_from_wire

        self._collected = frame["records"]
        return [output_from_wire(o) for o in frame["outputs"]]

    def generate(self, prompts: list[Any], params: list[Any], progress: Any = None) -> list[Any]:
        bar = progress(total=len(prompts)) if progress else None
        done = 0
        try:
            for frame in self._frames(prompts, params, stream=bar is not None):
                if frame["kind"] == "done":
                    return self._done(frame)
                now = sum(1 for o in frame["outputs"] if o is not None and o["finished"])
                if bar is not None and now > done:
                    bar.update(now - done)
                    done = now
        finally:
            if bar is not None:
                bar.close()
        raise ServerGone(f"the vlens server at {self.url} ended the call without results")

    def stream(self, prompts: list[Any], params: list[Any]) -> Iterator[list[Any]]:
        from vlens.remote.wire import merge_delta, output_from_wire

        frames = self._frames(prompts, params, stream=True)
        have: list[dict[str, Any] | None] = [None] * len(prompts)
        try:
            for frame in frames:
                if frame["kind"] == "done":
                    yield self._done(frame)
                    return
                have = [merge_delta(h, o) for h, o in zip(have, frame["outputs"], strict=True)]
                yield [output_from_wire(o) for o in have]
        finally:
            frames.close()
        raise ServerGone(f"the vlens server at {self.url} ended the call without results")


def connect(url: str = "http://127.0.0.1:8765", token: str | None = None, *,
            timeout: float = 30.0):
    """A :class:`~vlens.Session` on a ``vlens serve`` server: the same API,
    with the server's model. ``token``: yours (default: ``$VLENS_TOKEN``).

    Differences from a local Session: ``edit=`` functions are refused (code
    does not cross the wire: use ``Steer``, ``Ablate`` or patching), and the
    server's limits (read bytes per call, calls at once, prompt length)
    apply; ``s.engine.limits`` shows them."""
    from vlens.session import Session

    token = token if token is not None else os.environ.get("VLENS_TOKEN")
    if not token:
        raise VlensError("vlens.connect needs token=... (or $VLENS_TOKEN): "
                         "the server's operator gives each participant one")
    token = token.strip()  # a token pasted or read from a file with its newline
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise VlensError("the token holds spaces, control or non-ASCII characters: copy it "
                         "again exactly as the workshop's operator gave it (it is not shown "
                         "here)")
    return Session._attach(RemoteEngine(url, token, timeout=timeout))
