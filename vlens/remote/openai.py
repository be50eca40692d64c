"""The engine behind the OpenAI-compatible routes of ``vlens serve``
(:mod:`vlens.remote.openai_routes`), with steering in the body::

    client.chat.completions.create(model=..., messages=[...], extra_body={
        "vlens": {"steer": [{"vector": "mood", "layer": 3, "scale": 4.0,
                             "span": "assistant"}]}})

The routes are vLLM's own serving classes (``OpenAIServingChat``,
``OpenAIServingCompletion``, ``OpenAIServingModels``) over the server's
one ``AsyncLLM``, so request and response shapes, sampling settings, chat
templates, logprobs and usage counts are ``vllm serve``'s. The one change
is the engine they call: :class:`SteeredEngine` is the AsyncLLM with
``generate`` wrapped. When vLLM hands it a request (token ids known,
template applied), it builds that request's vlens plan from the body's
``vlens`` object (parsed and checked before vLLM sees the request,
:mod:`vlens.edit_schema`; its spans and ablations on the prompt by
:meth:`~vlens.edit_schema.BodyEdits.fit`), re-checks the plan with the rules every plan
passes (:func:`vlens.checks.check_plan`), holds the vectors it names in
the workers under the participant's prefix, and runs it exactly as a
``vlens.connect`` call runs: the plan in ``extra_args``, the edits'
prefix-cache salt in the prompt.

The participant's token is the API key; a call takes one of its slots
(``--max-concurrent``, waiting in line for one if need be) until its
answer is sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from dataclasses import dataclass
from typing import Any

from vlens.checks import check_plan
from vlens.remote.schema import BodyEdits, BodyError
from vlens.edits import engine_prompt
from vlens.errors import VlensError
from vlens.methods.ablation import to_sets
from vlens.prompts import normalise
from vlens.protocol.plan import PLAN_KEY, Add, Plan
from vlens.protocol.tensors import encode_tensor
from vlens.remote.guard import Refused

__all__ = ["BadBody", "PENDING", "Pending", "SteeredEngine", "error_json"]


class BadBody(Refused):
    """A refusal in OpenAI's error shape, naming the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message)
        self.param = param


def error_json(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             408: "RequestTimeout", 413: "RequestTooLarge", 415: "UnsupportedMediaType",
             429: "RateLimitError", 503: "ServiceUnavailable"}
    return {"error": {"message": message, "type": kinds.get(status, "Error"), "param": param,
                      "code": status}}


@dataclass
class Pending:
    """The request vLLM is about to hand to the engine: who sent it, its
    edits and (for role spans) its conversation."""

    client: Any
    edits: BodyEdits
    chat: Any = None  # the ChatCompletionRequest, for role spans


PENDING: contextvars.ContextVar[Pending | None] = contextvars.ContextVar(
    "vlens_openai_pending", default=None)


class SteeredEngine:
    """The server's AsyncLLM as vLLM's serving classes see it, with each
    request's vlens plan put in (see the module's docstring)."""

    def __init__(self, server: Any, chat_template: str | None) -> None:
        self._server = server
        self._llm = server.llm
        self._chat_template = chat_template
        self._cleanups: set[Any] = set()
        self._to_drop: list[str] = []  # plans of finished calls, dropped together
        self._dropping: asyncio.Future | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kw: Any) -> Any:
        """Checked here, before the request exists: a refusal is raised out
        of vLLM's handler (the route answers it), not streamed."""
        pending = PENDING.get()
        server = self._server
        if pending is None:  # a route of vLLM's that vlens does not serve
            raise BadBody(404, "this route is not served")
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if not isinstance(ids, list):
            raise BadBody(400, "vlens serves text and token prompts only", "prompt")
        if len(ids) > server.limits.prompt_tokens:
            raise BadBody(413, f"{len(ids)} prompt tokens; this server takes at most "
                                f"{server.limits.prompt_tokens} per prompt", "prompt")
        if (sampling_params.n or 1) > server.limits.samples:
            raise BadBody(400, f"n must be at most {server.limits.samples} on this server", "n")
        if sampling_params.extra_args:
            raise BadBody(400, "vllm_xargs is not accepted by vlens serve: steer with the "
                                "'vlens' object", "vllm_xargs")
        if not pending.edits:
            return self._llm.generate(prompt, sampling_params, request_id, **kw)
        plan, vectors = self._plan(pending, ids, sampling_params.max_tokens)
        sampling_params.extra_args = {PLAN_KEY: plan.to_wire()}
        salt = engine_prompt(ids, plan).get("cache_salt")
        prompt = dict(prompt)
        prompt["cache_salt"] = f"{prompt['cache_salt']}|{salt}" if prompt.get(
            "cache_salt") else salt
        return self._run(pending.client, prompt, sampling_params, request_id, kw, vectors,
                         plan.tag)

    async def _run(self, client: Any, prompt: Any, sp: Any, rid: str, kw: dict[str, Any],
                   vectors: dict[str, Any], tag: str):
        import anyio

        server = self._server
        await server.hold_vectors(client, vectors)
        finished = False
        try:
            async for out in self._llm.generate(prompt, sp, rid, **kw):
                finished = bool(getattr(out, "finished", False))
                yield out
        finally:
            # the clean-up's engine calls run beside the answer, not before
            # its last event: a task, kept until done
            with anyio.CancelScope(shield=True):
                task = asyncio.ensure_future(self._forget(client, rid, tag, vectors, finished))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def _forget(self, client: Any, rid: str, tag: str, vectors: dict[str, Any],
                      finished: bool) -> None:
        """After a steered call: abort its request unless the engine finished
        it (a client that left early), release its vectors, and drop its
        plan in the workers -- with the plans of every other call that ended
        meanwhile, in one engine call."""
        try:
            if not finished:
                await self._llm.abort([rid])
        finally:
            await self._server.release_vectors(client, vectors)
        self._to_drop.append(tag)
        if self._dropping is None:
            self._dropping = asyncio.ensure_future(self._drop_plans())

    async def _drop_plans(self) -> None:
        try:
            while self._to_drop:
                tags, self._to_drop = self._to_drop, []
                await self._llm.collective_rpc("vlens_drop", args=(tags,))
        finally:
            self._dropping = None

    def _plan(self, pending: Pending, ids: list[int], max_tokens: int):
        """The request's plan over its token ids, and the vectors it names
        (``{participant/id: encoded}``)."""
        server, edits = self._server, pending.edits
        facts, n = server.facts, len(ids)
        owner = pending.client.name
        held: dict[str, Any] = {}

        def roles(field: str) -> Any:  # the conversation, normalised once
            if "p" not in held:
                held["p"] = self._roles(pending, ids, field)
            return held["p"]

        try:  # spans on this prompt, the Ablate rule: as a Session's own call runs them
            steers, ablates = edits.fit(facts, n, max_tokens, roles)
        except BodyError as exc:
            raise BadBody(400, str(exc), exc.field) from None
        tensors: dict[str, Any] = {}
        adds = []
        for st in steers:
            sae = getattr(st, "sae", None)
            tensors[st.id] = st.vector
            adds.append(Add(st.site, st.layer, f"{owner}/{st.id}", float(st.scale),
                            *st.positions(n), relative=st.relative,
                            **({"sae": sae.id, "feature": st.feature} if sae else {})))
        sets, set_vectors = to_sets(ablates, n, facts.head_dim)
        tensors.update(set_vectors)
        from dataclasses import replace

        sets = [replace(s, vec=f"{owner}/{s.vec}") if s.vec else s for s in sets]
        plan = Plan(tag=f"{owner}/oai-{uuid.uuid4().hex[:12]}", adds=tuple(adds),
                    sets=tuple(sets), prompt_len=n)
        sizes = {f"{owner}/{vid}": (int(v.numel()), float(v.abs().max()))
                 for vid, v in tensors.items()}
        # the steering writes met the Steer rule in the body's parse: not again here
        ruled = {(a.site, a.layer, a.vec, a.scale, a.relative, a.sae, a.feature) for a in adds}
        try:
            check_plan(plan, facts, sizes, max_tokens, seen=ruled)  # the rules every plan passes
            server.names.check_plan_saes(plan)
        except VlensError as exc:
            raise BadBody(400, f"vlens: {exc}", "vlens") from None
        return plan, {f"{owner}/{vid}": encode_tensor(v) for vid, v in tensors.items()}

    def _roles(self, pending: Pending, ids: list[int], field: str) -> Any:
        """The conversation normalised as a local Session does it, for its
        roles; its ids must be the ones vLLM rendered."""
        req = pending.chat
        if req is None:
            raise VlensError("a role span needs a chat completion (a completion's prompt has "
                             "no roles)")
        conv = []
        for m in req.messages:
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, str):
                raise VlensError("role spans need messages whose content is a plain string")
            conv.append({"role": m["role"], "content": content})
        prompt = normalise([{
            "messages": conv, "chat_template": self._chat_template,
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            **({"chat_template_kwargs": req.chat_template_kwargs}
               if req.chat_template_kwargs else {})}],
            self._llm.renderer.tokenizer, self._server.facts.max_model_len + 1)[0]
        if prompt.ids != ids:
            raise VlensError("the conversation's tokens as vlens formats it differ from the "
                             "ones the server rendered (tools or template options?): use "
                             "span 'all', 'prompt', 'generated' or [start, stop]")
        return prompt
