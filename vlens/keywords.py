"""Keyword arguments checked by name: a typo is a ``TypeError`` that names
the closest real keyword, an old (v0.3) name one that names its
replacement, and a sampling setting is matched against vLLM's
``SamplingParams`` by name. Every Session method and the edit classes
take their keywords through :func:`keywords`. Imports nothing of vlens.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RENAMED", "SAMPLING", "keywords", "same_keywords"]

#: the settings of vLLM's ``SamplingParams`` a call may name (``max_tokens`` is
#: ``max_new_tokens`` here; the log-probability ones are vlens's own, and
#: refused with that explanation by :func:`vlens.checks.check_generation`);
#: a test holds this list to vLLM's
SAMPLING = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias",
    "allowed_token_ids", "bad_words", "max_tokens", "extra_args", "logprob_token_ids",
    "skip_reading_prefix_cache",
)

#: old keyword names (v0.3) and the names that replaced them; no shims: an
#: old name is a TypeError that says the new one
RENAMED = {
    "query_heads": "heads",
    "per_head": "heads",
    "positions": "span",
    "position": "span",
}

#: per method, where one old name became something else
RENAMED_IN = {"Clamp": {"scale": "value"}}

#: an old name whose values changed too: what to write now
HOW = {"per_head": "heads='all' (per_head=True) or leave it out (per_head=False)"}


def _refuse(method: str, key: str, named: Sequence[str], sampling: bool) -> TypeError:
    new = RENAMED_IN.get(method, {}).get(key) or RENAMED.get(key)
    if new is not None and new in named:
        how = HOW.get(key, f"{new}=")
        return TypeError(f"{method}() takes {how} now ({key}= was its old name)")
    pool = list(named) + (list(SAMPLING) if sampling else [])
    close = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}=?" if close else ""
    also = " or a sampling setting of vLLM's SamplingParams" if sampling else ""
    return TypeError(f"{method}() got an unknown keyword {key!r}{hint} "
                     f"({method} takes {', '.join(n + '=' for n in named)}{also})")


def keywords(fn: Callable) -> Callable:
    """Check a function's keyword arguments by name before it runs: an
    unknown one is a TypeError naming the closest real one (its own
    keywords, and vLLM's sampling settings when it takes ``**sampling``),
    an old one names its replacement. The signature stays the function's."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    named = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
             and p.name not in ("self", "cls")]
    sampling = any(p.kind == p.VAR_KEYWORD for p in params)
    method = fn.__name__ if fn.__name__ != "__init__" else fn.__qualname__.split(".")[0]

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for key in kwargs:
            if key not in named and not (sampling and key in SAMPLING):
                raise _refuse(method, key, named, sampling)
        return fn(*args, **kwargs)

    return checked


def same_keywords(model: Callable) -> Callable[[Callable], Callable]:
    """Give the decorated method ``fn(self, args)`` the keywords of
    ``model``, written once: its signature is ``model``'s (what ``help``,
    completion and :func:`keywords` read), and it receives every argument
    bound by that signature, defaults applied, as one dict (``**sampling``
    as a dict under its own name). ``Session.stream`` takes ``trace``'s so."""
    sig = inspect.signature(model)

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def bound(self: Any, *args: Any, **kwargs: Any) -> Any:
            call = sig.bind(self, *args, **kwargs)
            call.apply_defaults()
            return fn(self, dict(call.arguments))

        del bound.__wrapped__  # the signature below, not fn's own
        bound.__signature__ = sig.replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(fn).return_annotation)
        return bound

    return wrap
