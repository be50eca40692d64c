"""The server's checks on everything a client sends, before any of it
reaches the engine.

A client is not trusted: its plans are parsed and re-checked here against
the model (sites, layers, reductions, spans), its steering vectors against
the hidden size, its sampling settings against a whitelist, and its call
against the server's per-client limits. The plan's tag and vector ids are
then prefixed with the client's name, so a client's requests can only ever
read into, and be collected by, that client.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from vlens.checks import PLAN_MAX, REMOTE_EDIT, ModelFacts, check_budget
from vlens.checks import check_plan as check_plan_rules
from vlens.edits import vector_id
from vlens.errors import VlensError
from vlens.protocol.plan import PLAN_KEY, Plan, parse_plan
from vlens.protocol.tensors import decode_tensor
from vlens.remote.wire import PARAM_FIELDS

__all__ = ["Refused", "Limits", "Checked", "check_call"]

_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # used with fullmatch: no trailing newline
_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _strict_equal(a: Any, b: Any) -> bool:
    """JSON-like ``a == b`` where types count too (``True`` is not ``1``,
    ``1`` is not ``1.0``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_strict_equal(x, y) for x, y in zip(a, b))
    return a == b


class Refused(Exception):
    """A request the server turns down: HTTP ``status`` and why."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        #: seconds a client should wait before trying again (429, 503)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


@dataclass(frozen=True)
class Limits:
    """Per-client limits, set with ``vlens serve`` flags."""

    read_bytes: int = 256 * 2**20  # activations one call may read
    concurrent: int = 4  # calls of one client in flight at once
    queued: int = 64  # calls of one client waiting for a slot (more: 429)
    queue_seconds: float = 600.0  # how long a call may wait for a slot
    prompt_tokens: int = 4096  # tokens in one prompt
    requests: int = 256  # engine requests in one call
    samples: int = 16  # n per request
    vectors: int = 64  # steering vectors one call may ship
    body_bytes: int = 64 * 2**20  # one request body
    body_seconds: float = 30.0  # to send one request body
    stall_seconds: float = 30.0  # a stream's reader may stop reading this long

    def public(self) -> dict[str, Any]:
        return {**self.__dict__, **{f"plan_{k}": v for k, v in PLAN_MAX.items()}}


@dataclass
class Checked:
    """One call, checked: per request its token ids, server-made
    SamplingParams and prefixed tag (None: no plan); the vectors to hold."""

    ids: list[list[int]]
    params: list[Any]
    tags: list[str | None]
    vectors: dict[str, dict[str, Any]]


def _bad(message: str) -> Refused:
    return Refused(400, message)


def _int(x: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
        raise _bad(f"{what} must be a whole number from {lo} to {hi}, got {x!r:.60}")
    return x


def check_vector(vid: Any, payload: Any, widths: set[int]) -> tuple[dict[str, Any], float]:
    """One steering / ablation / patching vector: ``[width]`` of a writable
    site. Returns it and its largest ``|value|`` (what bounds its writes)."""
    if not isinstance(vid, str) or not _ID.fullmatch(vid):
        raise _bad(f"vector id {vid!r:.60} is not a vlens id (1-128 of A-Z a-z 0-9 _ . : -)")
    if not isinstance(payload, dict) or set(payload) != {"data", "shape", "dtype"}:
        raise _bad(f"vector {vid}: expected {{data, shape, dtype}}")
    size = _DTYPES.get(payload["dtype"]) if isinstance(payload["dtype"], str) else None
    if size is None:
        raise _bad(f"vector {vid}: dtype must be one of {sorted(_DTYPES)}")
    shape = payload["shape"]
    if not (isinstance(shape, list) and len(shape) == 1 and shape[0] in widths
            and not isinstance(shape[0], bool)):
        raise _bad(f"vector {vid}: shape must be [width] of a writable site, one of "
                   f"{sorted(widths)}; got {shape!r:.60}")
    data = payload["data"]
    if not isinstance(data, bytes) or len(data) != shape[0] * size:
        raise _bad(f"vector {vid}: data must be {shape[0] * size} bytes")
    import torch  # a server process has it; kept out of `import vlens.remote.guard`

    values = decode_tensor(payload).float()
    if not torch.isfinite(values).all():
        raise _bad(f"vector {vid} holds NaN or infinite values")
    if vector_id(values) != vid:
        # ids are the hash of the data: a vector cached under an id is that data,
        # whoever sends it (peers sharing one token included)
        raise _bad(f"vector id {vid!r:.60} is not the hash of its data "
                   "(vlens.edits.vector_id)")
    return payload, float(values.abs().max())


def check_plan(raw: Any, ids: list[int], facts: ModelFacts,
               vectors: dict[str, tuple[int, float]], client: str, max_tokens: int,
               saes: Any = None, seen: set | None = None) -> Plan:
    """Parse and check a client's plan with the Session's own checks
    (:func:`vlens.checks.check_plan`); return it with the tag and vector ids
    prefixed by ``client``. ``vectors``: ``{id: (width, largest |value|)}``;
    ``saes``: checks the SAEs a plan names against the server's (None: a
    plan may name none)."""
    try:
        plan = parse_plan(raw)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise _bad(f"malformed plan: {exc}") from None
    if not _strict_equal(plan.to_wire(), raw):  # only the canonical form
        raise _bad("malformed plan: it is not in the form vlens writes plans "
                   "(wrong types, missing or extra fields; are the client's and the "
                   "server's vlens the same version?)")
    if plan.edits:
        raise _bad(REMOTE_EDIT)
    if not _ID.fullmatch(plan.tag):
        raise _bad(f"plan tag {plan.tag!r:.60} is not a vlens tag")
    if plan.prompt_len != len(ids):
        raise _bad(f"plan prompt_len {plan.prompt_len} != the prompt's {len(ids)} tokens")
    _int(plan.index, "plan index", 0, 1 << 20)
    try:
        check_plan_rules(plan, facts, vectors, max_tokens, seen)
        if saes is not None:
            saes(plan)
        elif any(r.sae for r in plan.reads + plan.adds):
            raise VlensError("this server loads no SAEs (vlens serve --sae NAME=PATH)")
    except VlensError as exc:
        raise _bad(str(exc)) from None
    owner = client.split("/", 1)[0]  # vectors: the client's; the tag: this call's
    adds = tuple(replace(a, vec=f"{owner}/{a.vec}") for a in plan.adds)
    sets = tuple(replace(w, vec=f"{owner}/{w.vec}" if w.vec else "") for w in plan.sets)
    return replace(plan, tag=f"{client}/{plan.tag}", adds=adds, sets=sets)


_NUM = (int, float)
_KINDS: dict[str, tuple] = {
    "n": (int,), "temperature": _NUM, "top_p": _NUM, "top_k": (int, type(None)),
    "min_p": _NUM, "seed": (int, type(None)), "max_tokens": (int,), "min_tokens": (int,),
    "logprobs": (int, type(None)), "prompt_logprobs": (int, type(None)),
    "presence_penalty": _NUM, "frequency_penalty": _NUM, "repetition_penalty": _NUM,
    "stop": (list, type(None)), "stop_token_ids": (list, type(None)), "ignore_eos": (bool,),
    "skip_special_tokens": (bool,), "spaces_between_special_tokens": (bool,),
    "include_stop_str_in_output": (bool,), "skip_reading_prefix_cache": (bool, type(None)),
    "extra_args": (dict, type(None)), "logprob_token_ids": (list, type(None)),
}
assert set(_KINDS) == set(PARAM_FIELDS)


def check_params(raw: Any, ids: list[int], facts: ModelFacts, limits: Limits,
                 vectors: dict[str, tuple[int, float]], client: str, saes: Any = None,
                 seen: set | None = None) -> tuple[Any, Plan | None]:
    """A whitelisted params dict -> (vLLM SamplingParams, checked plan);
    ``seen``: the call's steering writes checked so far (each once)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if not isinstance(raw, dict):
        raise _bad("params must be an object")
    unknown = set(raw) - set(PARAM_FIELDS)
    if unknown:
        raise _bad(f"sampling settings {sorted(unknown)} are not accepted; "
                   f"allowed: {', '.join(PARAM_FIELDS)}")
    for key, value in raw.items():
        kinds = _KINDS[key]
        if value is None and type(None) in kinds:
            continue
        if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
            raise _bad(f"sampling setting {key}={value!r:.40} has the wrong type")
        if isinstance(value, float) and not math.isfinite(value):
            raise _bad(f"sampling setting {key} must be a finite number")
    args = dict(raw)
    _int(args.get("n", 1), "n", 1, limits.samples)
    _int(args.get("min_tokens", 0), "min_tokens", 0, facts.max_model_len)
    if args.get("seed") is not None:
        _int(args["seed"], "seed", 0, 2**63 - 1)
    if args.get("top_k") is not None:
        _int(args["top_k"], "top_k", -1, facts.vocab_size)
    max_tokens = _int(args.get("max_tokens", 16), "max_tokens", 1, facts.max_model_len)
    if len(ids) + max_tokens > facts.max_model_len:
        raise _bad(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                   f"model's max_model_len {facts.max_model_len}")
    for key in ("logprobs", "prompt_logprobs"):
        if args.get(key) is not None:
            _int(args[key], key, 0, 20)
    stop = args.get("stop")
    if stop is not None and not (isinstance(stop, list) and len(stop) <= 16 and all(
            isinstance(s, str) and 0 < len(s) <= 200 for s in stop)):
        raise _bad("stop must be a list of at most 16 strings")
    stop_ids = args.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and len(stop_ids) <= 64):
        raise _bad("stop_token_ids must be a list of at most 64 token ids")
    for t in stop_ids or ():
        _int(t, "stop token id", 0, facts.vocab_size - 1)
    scored = args.get("logprob_token_ids")
    if scored is not None and not len(scored) <= 256:
        raise _bad("logprob_token_ids must list at most 256 token ids")
    for t in scored or ():
        _int(t, "logprob token id", 0, facts.vocab_size - 1)
    extra = args.pop("extra_args", None)
    plan = None
    if extra is not None:
        if not isinstance(extra, dict) or set(extra) != {PLAN_KEY}:
            raise _bad(f"extra_args may hold only {{{PLAN_KEY!r}: plan}}")
        plan = check_plan(extra[PLAN_KEY], ids, facts, vectors, client, max_tokens, saes, seen)
        args["extra_args"] = {PLAN_KEY: plan.to_wire()}
    try:
        sp = SamplingParams(**args)
        # the engine core decodes requests with msgspec's typed decoder, and a
        # value it rejects there kills its input thread: check the same way here
        import msgspec

        msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    except Exception as exc:  # noqa: BLE001 - vLLM's validation errors vary
        raise _bad(f"bad sampling settings: {exc}") from None
    sp.output_kind = RequestOutputKind.CUMULATIVE
    return sp, plan


def check_call(body: Any, facts: ModelFacts, limits: Limits, client: str,
               call: str = "", saes: Any = None) -> Checked:
    """A decoded /v1/generate body -> a :class:`Checked` call, or Refused.
    Tags are prefixed by ``client/call`` (``call``: unique per call, so two
    calls with the same tag, even under one shared token, never meet);
    vector ids by ``client`` (they are hashes of their data)."""
    if not isinstance(body, dict) or not isinstance(body.get("requests"), list):
        raise _bad("body must be {requests: [...], vectors: {...}, stream: bool}")
    if set(body) - {"requests", "vectors", "stream"}:
        raise _bad(f"unknown fields {sorted(set(body) - {'requests', 'vectors', 'stream'})}")
    reqs = body["requests"]
    if not 1 <= len(reqs) <= limits.requests:
        raise Refused(413 if reqs else 400,
                      f"a call holds 1 to {limits.requests} requests, got {len(reqs)}")
    raw_vectors = body.get("vectors") or {}
    if not isinstance(raw_vectors, dict) or len(raw_vectors) > limits.vectors:
        raise Refused(413, f"vectors must be an object of at most {limits.vectors} vectors")
    widths = {facts.width(site) for site in facts.writable}
    checked = {vid: check_vector(vid, p, widths) for vid, p in raw_vectors.items()}
    vectors = {vid: p for vid, (p, _) in checked.items()}
    sizes_of = {vid: (p["shape"][0], peak) for vid, (p, peak) in checked.items()}
    ids_all, params, tags, sizes = [], [], [], []
    seen: set = set()  # the steering writes checked so far: one call checks each once
    for i, req in enumerate(reqs):
        if not isinstance(req, dict) or set(req) != {"ids", "params"}:
            raise _bad(f"request {i} must be {{ids, params}}")
        ids = req["ids"]
        if not isinstance(ids, list) or not ids:
            raise _bad(f"request {i}: ids must be a non-empty list of token ids")
        if len(ids) > limits.prompt_tokens:
            raise Refused(413, f"request {i}: {len(ids)} prompt tokens; this server takes at "
                               f"most {limits.prompt_tokens} per prompt")
        for t in ids:
            _int(t, f"request {i} token id", 0, facts.vocab_size - 1)
        sp, plan = check_params(req["params"], ids, facts, limits, sizes_of,
                                f"{client}/{call}" if call else client, saes, seen)
        ids_all.append(ids)
        params.append(sp)
        tags.append(plan.tag if plan else None)
        if plan is not None:
            sizes.append((len(ids), plan.reads, sp.max_tokens, sp.n))
    sequences = sum(sp.n or 1 for sp in params)
    if sequences > limits.requests:
        raise Refused(413, f"this call runs {sequences} sequences (prompts x n); this server "
                           f"takes at most {limits.requests} per call")
    # vLLM works out the log-probabilities over the whole vocabulary for every
    # row that asks (prompt_logprobs: every prompt row): count them as reads
    lp_bytes = sum(4 * facts.vocab_size * (
        (len(i) if sp.prompt_logprobs is not None else 0)
        + ((sp.n or 1) * sp.max_tokens if sp.logprobs is not None else 0))
        for i, sp in zip(ids_all, params))
    if lp_bytes > limits.read_bytes:
        raise Refused(413, f"the log-probabilities this call asks for cover about "
                           f"{lp_bytes / 2**20:.0f} MiB of the vocabulary, over this server's "
                           f"limit of {limits.read_bytes / 2**20:.0f} MiB per call: ask for "
                           "fewer or shorter prompts, or logprobs=False")
    try:
        check_budget(sizes, facts, limits.read_bytes)
    except VlensError as exc:
        raise Refused(413, f"over this server's read limit per call: {exc}") from None
    return Checked(ids_all, params, tags, {f"{client}/{k}": v for k, v in vectors.items()})
