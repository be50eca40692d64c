"""The engine a Session's runner drives, as one interface.

Two classes implement it: :class:`vlens.engine.Engine` (vLLM in this
process's reach) and :class:`vlens.remote.client.RemoteEngine` (a ``vlens
serve`` server over HTTP). The runner (``vlens/_runner.py``) uses nothing
of an engine but what :class:`EngineAPI` declares, so every Session method
and widget works unchanged on either. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineAPI"]


@runtime_checkable
class EngineAPI(Protocol):
    """What a Session's runner uses of its engine, local or connected."""

    #: the model's description: n_layers, hidden_size, impl, sites, max_model_len, ...
    info: dict[str, Any]
    #: the model's tokenizer (a Hugging Face tokenizer)
    tokenizer: Any
    #: guards the engine's bookkeeping (what its workers hold); a connection
    #: also answers one call at a time under it
    lock: AbstractContextManager[Any]
    #: the model: its folder here, or ``URL/FOLDER`` on a server
    model: str
    #: whether the engine is a ``vlens serve`` server (``vlens.connect``)
    remote: bool
    #: whether the engine's workers run in this process (``edit=`` functions reach them)
    in_process: bool
    #: whether the model runs compiled (torch.compile / CUDA graphs) rather than eager
    compiled: bool
    #: how many engine batches this engine has run
    generate_calls: int

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (a closed engine runs nothing)."""
        ...

    def check_open(self) -> None:
        """Raise :class:`~vlens.ClosedError` if the engine is closed."""
        ...

    def close(self) -> None:
        """Shut the engine down (a connection: close it); idempotent."""
        ...

    def hold_vectors(self, vectors: Mapping[str, Any]) -> AbstractContextManager[None]:
        """Make the workers hold ``{id: tensor}`` steering vectors for the block."""
        ...

    def hold_saes(self, payloads: Mapping[str, Any], *, owner: Any = None) -> None:
        """Make the workers hold these SAEs' encoders (``{id: payload}``) for
        ``owner`` until it releases them."""
        ...

    def release_saes(self, ids: Iterable[str], *, owner: Any = None) -> None:
        """``owner`` is done with the SAEs ``ids``; the workers drop those no
        one else holds."""
        ...

    def request_params(self, settings: Mapping[str, Any]) -> Any:
        """One request's params from ``SamplingParams``'s keywords: vLLM's
        ``SamplingParams`` (its own checks), or on a connection the wire's
        dict of them (the server checks them and makes them; the client
        imports no vLLM)."""
        ...

    def generate(self, prompts: list[Any], params: list[Any], progress: Any = None, *,
                 owner: Any = None) -> list[Any]:
        """Run one batch of requests (sharing engine steps with other
        callers'); its outputs, one per prompt."""
        ...

    def stream(self, prompts: list[Any], params: list[Any], *,
               owner: Any = None) -> Iterator[list[Any]]:
        """Run one batch of requests, yielding every prompt's output after each step."""
        ...

    def cancel(self, owner: Any, error: BaseException) -> int:
        """Abort every batch ``owner`` has running (its callers get
        ``error``); how many batches."""
        ...

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """Call the workers' ``method``; one result per worker, rank 0 first."""
        ...
