"""The notebook's handle on a live engine.

A ``Session`` holds (a share of) one :class:`~vlens.engine.Engine`. Each
method checks its keywords, has a call builder in :mod:`vlens.methods`
check its inputs and build one :class:`~vlens.calls.Call`, and runs it on
its runner (:mod:`vlens._runner`). Widgets and notebooks use only this API.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from vlens import calls, checks
from vlens._runner import Runner, env_flag, live_engines
from vlens.calls import Call
from vlens.edits import Steer
from vlens.engine.engine import start_options
from vlens.engine.quiet import start_line
from vlens.engine.startup import resolve_model
from vlens.errors import VlensError
from vlens.keywords import keywords, same_keywords
from vlens.methods import (attribution, directions, gradients, harvest as harvesting,
                           patching, server_names, steering, traces)
from vlens.methods.twin import Twin, held
from vlens.methods import branches as branching
from vlens.prompts import Prompt, normalise
from vlens.results import Comparison, Run, Sweep

__all__ = ["Session", "live_engines"]


class Session:
    """A live vLLM engine with vlens's hooks, from a notebook.

    ``Session()`` loads the bundled toy-world model; ``Session(path, **kw)``
    any local model folder, with ``kw`` passed to ``vllm.LLM`` (for example
    ``model_impl="transformers"``, ``max_model_len=512``,
    ``max_num_batched_tokens=64``). A second Session with the same model and
    arguments in one process shares the live engine unless ``reuse=False``.

    A new engine starts quietly and prints one line (model, route, eager or
    compiled, KV cache, seconds to start); ``verbose=True`` (or
    ``VLENS_VERBOSE=1``) shows vLLM's own log instead. Errors show either way.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, reuse: bool = True,
                 verbose: bool | None = None, **llm_kwargs: Any) -> None:
        if verbose is not None and not isinstance(verbose, bool):
            raise VlensError(f"verbose must be True or False, got {verbose!r}")
        self.model = resolve_model(model)
        with start_options(verbose=verbose):
            self._runner = Runner(self.model, llm_kwargs, reuse=reuse)
        self._setup()
        print(start_line(self.model, self.engine, self.reused), flush=True)

    @classmethod
    def on_engine(cls, engine: Any) -> Session:
        """A Session on an engine made elsewhere (``vlens.connect``'s remote
        engine); the same API as one that starts its own."""
        self = cls.__new__(cls)
        self.model = engine.model
        self._runner = Runner(self.model, {}, reuse=False, engine=engine)
        self._setup()
        return self

    def _setup(self) -> None:
        self.reused = self._runner.reused
        self.clone_reads = env_flag("VLENS_CLONE_READS")
        #: the most bytes of activations one call may read (refused above it)
        self.read_budget = int(float(os.environ.get("VLENS_READ_BUDGET_MB", "2048")) * 2**20)
        #: conversations' chat template (None: the tokenizer's) and its
        #: keyword arguments, as vLLM's ``LLM.chat`` takes them
        self.chat_template: str | None = None
        self.chat_template_kwargs: dict[str, Any] = {}
        self._twin: Twin | None = None  # s.twin(), built on first use

    def prompts(self, prompts: Any) -> list[Prompt]:
        """Prompts of any form (a string, a conversation, token ids, or a
        list of these) as :class:`~vlens.prompts.Prompt` objects: the ids the
        engine runs, the formatted text, offsets and per-token roles."""
        return normalise(prompts, self.tokenizer, self.facts.max_model_len,
                         reader=self._runner.reader, chat_template=self.chat_template,
                         chat_template_kwargs=self.chat_template_kwargs)

    # -- what the model is ----------------------------------------------------
    @property
    def engine(self):
        """The live :class:`~vlens.engine.Engine` (shared with other Sessions
        of the same model and arguments)."""
        return self._runner.engine

    @property
    def info(self) -> dict[str, Any]:
        return dict(self.engine.info)

    # what the model is, as its facts say
    n_layers = property(lambda self: self.facts.n_layers, doc="decoder layers")
    hidden_size = property(lambda self: self.facts.hidden_size, doc="residual width")
    sites = property(lambda self: list(self.facts.sites), doc="the site names it offers")
    max_model_len = property(lambda self: self.facts.max_model_len, doc="tokens per request")

    @property
    def facts(self) -> checks.ModelFacts:
        """What the model is (layers, sites and their widths, heads, vocabulary,
        the write bounds), as the input checks see it."""
        return self._runner.facts

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def closed(self) -> bool:
        return self._runner.closed

    def tokenize(self, text: str) -> list[int]:
        """The token ids the engine will see for ``text`` (with BOS if any)."""
        return list(self.tokenizer(text)["input_ids"])

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """Each id as readable text (decoded one by one, cached per id)."""
        return self._runner.token_strings(list(ids))

    @property
    def clone_reads(self) -> bool:
        """Serve copies instead of views of engine memory to code that runs
        inside the step (``edit=`` functions, worker-side reductions). Takes
        effect from the next run: the flag travels in each request's plan.
        Kept results are always copies (see docs/clone-reads.md)."""
        return self._clone_reads

    @clone_reads.setter
    def clone_reads(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise VlensError(f"clone_reads must be True or False, got {value!r}")
        self._clone_reads = value

    # -- tracing --------------------------------------------------------------
    @keywords
    def trace(
        self, prompts: str | Sequence[str], *,
        layers: int | Sequence[int] | None = None,
        sites: str | Sequence[str] = ("resid_post",),
        max_new_tokens: int = 16,
        logprobs: bool = True, background: Sequence[str] = (),
        steer: Any = None, ablate: Any = None, clamp: Any = None,
        edit: Any = None, edit_at: Sequence[tuple[str, int]] | None = None,
        reduce: str = "full", logit_lens: int = 0,
        heads: int | Sequence[int] | None = None,
        saes: Any = None, features_top_k: int = 0,
        progress: Any = None,
        **sampling: Any,
    ) -> Run:
        """Generate from each prompt and read ``sites`` at ``layers``.

        Greedy unless sampling settings (``temperature``, ``n`` …: vLLM's
        ``SamplingParams``, checked by name) say otherwise. One engine batch;
        each request reads and writes only its own rows. A
        :class:`~vlens.results.Run`, one trace per request (``n`` per prompt
        when ``n > 1``); ``t.activations(site, layer=L)`` or ``t[site, L]``.

        * ``steer``: a :class:`~vlens.Steer` or a list of them (all on every
          prompt), or ``vlens.PerPrompt([...])`` (one entry per prompt);
          ``ablate``: :class:`~vlens.Ablate` entries alike (zero, mean or a
          direction); ``clamp``: :class:`~vlens.Clamp` entries (an SAE feature
          set to a value); see docs/steering.md and docs/methods.md;
        * ``edit``: ``fn(rows, ctx) -> rows | None`` called with one
          request's rows at each ``edit_at`` (site, layer) pair, every step
          (a copy when ``clone_reads`` is on, else a view valid only during
          the call; in-process engines only);
        * ``reduce``: ``"full"`` or ``"norm"`` (the worker ships only norms);
          ``logit_lens=k`` also reads the logit lens top-k of ``resid_post``;
        * ``heads``: the query heads an ``attn_pattern`` read computes
          (None: all; it costs ``heads x T x T`` floats per layer);
        * ``saes``: a :class:`~vlens.SAE` or a list, encoded in the worker
          (``t.features(sae)``); ``features_top_k=k`` ships each token's k
          largest;
        * ``background``: prompts run in the same batch with no plan, as
          other users' traffic would (``run.background_texts``);
        * ``progress``: True for a progress bar, or ``fn(done, total)``
          called as requests finish (raising in it stops the run cleanly).

        A steer on generated tokens that covers none (the request stopped
        at its first token) is recorded (``steered_rows == 0``) with a
        :class:`~vlens.errors.VlensWarning` naming the prompts.
        """
        return self.run_call(self._trace_call(locals()), progress=progress)

    @keywords
    @same_keywords(trace)
    def stream(self, args: dict[str, Any]) -> Iterator[Run]:
        """``trace``, token by token, with the same keywords: after every
        engine step a partial Run (tokens and text so far, no reads), last
        the finished Run exactly as ``trace`` returns it. Closing the
        iterator early aborts the requests and leaves the engine clean."""
        return self._runner.stream(self._trace_call(args), budget=self.read_budget,
                                   progress=args["progress"])

    def _trace_call(self, args: dict[str, Any]) -> Call:
        """A trace's keywords (its ``locals()``) as its one call."""
        args = {k: v for k, v in args.items() if k not in ("self", "progress", "__class__")}
        plist, background = self.prompts(args.pop("prompts")), args.pop("background")
        spec = traces.TraceSpec(
            prompts=tuple(plist), facts=self.facts,
            background=tuple(self.prompts(list(background))) if background else (),
            clone=self.clone_reads, can_ship=self._runner.can_ship_functions,
            remote=self._runner.remote, **args)
        return traces.trace_call(spec)

    @keywords
    def generate(self, prompts: str | Sequence[str], *, max_new_tokens: int = 16,
                 **sampling: Any) -> list[str]:
        """Plain generation with no plan (the hooks stay idle): the texts."""
        checks.check_generation(max_new_tokens, sampling, self.facts)
        requests = [calls.background(p.ids, max_new_tokens, sampling)
                    for p in self.prompts(prompts)]
        return self.run_call(Call(requests, lambda outs, _, __: [o.outputs[0].text for o in outs]))

    def run_call(self, call: Call, *, progress: Any = None) -> Any:
        """Run a :class:`~vlens.calls.Call` a method built from this session's
        public surface (``vlens.diff``'s share of each model) on its engine,
        under its read budget; what the call's ``assemble`` returns."""
        return self._runner.run(call, budget=self.read_budget, progress=progress)

    # -- steering workflows ---------------------------------------------------
    @keywords
    def direction(self, positive: Sequence[str], negative: Sequence[str], *, layer: int,
                  site: str = "resid_post", span: Any = "last",
                  progress: Any = None) -> torch.Tensor:
        """Difference of means: ``mean(positive) - mean(negative)`` of ``site``
        at ``layer``, ``[hidden]`` float32 (at ``z``: ``[heads * head_dim]``,
        flat, as a Steer there takes it). Each prompt's rows of ``span`` are
        averaged first, ``span`` in the one span grammar (docs/concepts.md):
        ``"last"`` its last token, ``"prompt"`` every token (BOS included;
        ``slice(1, None)`` leaves it out), a role, a range or positions."""
        return directions.difference_of_means(self, positive, negative, layer=layer,
                                              site=site, span=span, progress=progress)

    @keywords
    def harvest(self, texts: Sequence[Any], *, layers: Any, sites: Any = ("resid_post",),
                out: str | os.PathLike, shard_tokens: int = 65536, progress: Any = None) -> Any:
        """Every token's rows of ``sites`` at ``layers`` over ``texts``, written to folder
        ``out`` as safetensors shards (whole texts, about ``shard_tokens`` tokens each)
        with a ``manifest.json``; run again, it resumes after the last finished shard. A
        :class:`~vlens.Harvest` (docs/features.md). ``progress``: True or ``fn(done, total)``."""
        return harvesting.harvest(self, texts, layers=layers, sites=sites, out=out,
                                  shard_tokens=shard_tokens, progress=progress)

    @keywords
    def compare(self, prompts: str | Sequence[str], *, steer: Any = None, ablate: Any = None,
                clamp: Any = None, max_new_tokens: int = 16, progress: Any = None,
                **sampling: Any) -> Comparison:
        """Baseline and edited generations of the same prompts in ONE engine
        batch: both texts, per-token logprobs, KL per position, first
        divergence. ``steer``, ``ablate`` and ``clamp`` take the same forms
        as in ``trace`` (at least one)."""
        call = steering.compare_call(self.prompts(prompts), self.facts, steer=steer,
                                     ablate=ablate, clamp=clamp, max_new_tokens=max_new_tokens,
                                     sampling=sampling, clone=self.clone_reads)
        return self.run_call(call, progress=progress)

    @keywords
    def stream_compare(self, prompts: str | Sequence[str], *, steer: Any = None,
                       ablate: Any = None, clamp: Any = None, max_new_tokens: int = 16,
                       progress: Any = None, **sampling: Any) -> Iterator[Any]:
        """``compare``, token by token: after every engine step a pair of
        partial Runs ``(baseline, edited)`` (tokens and text so far), and
        last the finished :class:`~vlens.results.Comparison`, exactly as
        ``compare`` returns it. Closing the iterator early aborts the run."""
        call = steering.compare_call(self.prompts(prompts), self.facts, steer=steer,
                                     ablate=ablate, clamp=clamp, max_new_tokens=max_new_tokens,
                                     sampling=sampling, clone=self.clone_reads)
        return self._runner.stream(call, budget=self.read_budget, progress=progress)

    @keywords
    def sweep(self, prompts: str | Sequence[str], *, steer: Steer, scales: Sequence[float],
              ablate: Any = None, clamp: Any = None, max_new_tokens: int = 16,
              progress: Any = None, **sampling: Any) -> Sweep:
        """``steer`` (a Steer, or a Clamp over values) at each of ``scales``
        on every prompt, all in ONE batch, plus an unedited baseline when 0
        is not among the scales. ``ablate`` and ``clamp`` hold on every arm,
        the baseline included."""
        call = steering.sweep_call(self.prompts(prompts), self.facts, steer=steer,
                                   scales=scales, ablate=ablate, clamp=clamp,
                                   max_new_tokens=max_new_tokens, sampling=sampling,
                                   clone=self.clone_reads)
        return self.run_call(call, progress=progress)

    @keywords
    def stream_sweep(self, prompts: str | Sequence[str], *, steer: Steer,
                     scales: Sequence[float], ablate: Any = None, clamp: Any = None,
                     max_new_tokens: int = 16, progress: Any = None,
                     **sampling: Any) -> Iterator[Any]:
        """``sweep``, token by token: after every engine step a tuple of
        partial Runs, one per scale (and the baseline last when it is its
        own arm), and last the finished :class:`~vlens.results.Sweep`."""
        call = steering.sweep_call(self.prompts(prompts), self.facts, steer=steer,
                                   scales=scales, ablate=ablate, clamp=clamp,
                                   max_new_tokens=max_new_tokens, sampling=sampling,
                                   clone=self.clone_reads)
        return self._runner.stream(call, budget=self.read_budget, progress=progress)

    # -- methods: patching ---------------------------------------------------
    @keywords
    def patch(self, clean: str, corrupt: str, *, site: str = "resid_post", layers: Any = None,
              span: Any = None, answer: Any = None, heads: Any = None,
              progress: Any = None) -> patching.Patching:
        """Activation patching: for every (layer, position) cell, the clean
        run's ``site`` row written into the corrupt run; ``.grid``
        ``[layers, positions]`` of the normalised logit difference (1: the
        clean answer restored, 0: the corrupt run's). ``span``: the clean
        prompt's positions (None: all; the span grammar of docs/concepts.md);
        ``answer=(clean, corrupt)`` token texts or ids (None: each run's top
        next token). ``site="z", heads="all"`` (or a list of heads): one cell
        per (layer, head) over all of ``span`` (``[layers, heads]``). One call in two engine
        batches (see docs/methods.md); ``progress`` counts both."""
        call = patching.patch_call(self, clean, corrupt, site, layers, span, answer, heads,
                                   progress)
        return self.run_call(call)

    @keywords
    def stream_patch(self, clean: str, corrupt: str, *, site: str = "resid_post",
                     layers: Any = None, span: Any = None, answer: Any = None,
                     heads: Any = None, progress: Any = None
                     ) -> Iterator[patching.Patching]:
        """``patch``, filling in: after every engine step a Patching with NaN
        where a cell has not finished; the last item equals ``patch``'s."""
        call = patching.patch_call(self, clean, corrupt, site, layers, span, answer, heads,
                                   progress)
        return self._runner.stream(call, budget=self.read_budget)

    # -- branching a generation (docs/methods.md) -------------------------------
    @keywords
    def branches(self, prompt: Any, at: Any, *, k: int = 3, max_new_tokens: int = 16,
                 steer: Any = None, steer_from: str = "start", background: Sequence[str] = (),
                 progress: Any = None, **sampling: Any) -> branching.Branches:
        """The run as it went and, at generated position(s) ``at`` (0: the first;
        ``[]``: none), its top-``k`` other tokens, each continued to
        ``max_new_tokens`` in all, in one batch sharing the prefix cache.
        ``steer_from``: ``"start"`` (every run) or ``"branch"`` (each branch from its token)."""
        call = branching.branch_call(self, prompt, at, k=k, max_new_tokens=max_new_tokens,
                                     steer=steer, steer_from=steer_from, background=background,
                                     sampling=sampling)
        return self.run_call(call, progress=progress)

    @keywords
    def continue_from(self, trace: Any, position: int, token: Any, *, max_new_tokens: int = 16,
                      steer: Any = None, steer_from: str = "start", **sampling: Any) -> Any:
        """``trace``'s generation up to ``position``, then ``token`` (one token's
        text or id), continued to ``max_new_tokens`` in all: a Trace with
        ``branch_point`` and ``forced`` set, as ``branches`` makes them."""
        call = branching.continue_call(self, trace, position, token,
                                       max_new_tokens=max_new_tokens, steer=steer,
                                       steer_from=steer_from, sampling=sampling)
        return self.run_call(call)

    # -- gradients, on a Hugging Face twin (docs/methods.md) -----------------
    @keywords
    def twin(self, device: str | None = None, *, path: Any = None) -> Twin:
        """The model in Hugging Face (float32, on ``device``; None: the held
        twin's, else "cpu") with the engine's sites as hooks, checked against
        the engine's reads first (refused with the differences). One per
        Session (another device or ``path``, a folder of the same model: a
        new one); ``close`` releases it."""
        self._twin = held(self, self._twin, device, path)
        return self._twin

    @keywords
    def attribution_patch(self, clean: str, corrupt: str, *, site: str = "resid_post",
                          layers: Any = None, span: Any = None, heads: Any = None,
                          answer: Any = None, metric: Any = "logit_diff") -> patching.Patching:
        """``patch``'s grid by attribution patching on ``s.twin()``: cell =
        grad metric(corrupt) . (clean - corrupt) at its site row, normalised
        as ``patch``'s. ``heads="all"`` (or a list) at ``z``: ``[layers, heads]`` summed
        over ``span``. ``metric``: ``"logit_diff"`` of ``answer`` (as
        ``patch``), or ``fn(last logits [vocab]) -> scalar``."""
        return gradients.attribution_patch(self, self.twin(), clean, corrupt, site, layers,
                                           span, heads, answer, metric)

    @keywords
    def saliency(self, prompt: str, *, target: Any = None, steps: int = 64,
                 baseline: Any = None) -> Any:
        """Gradient x input and integrated gradients (Captum, ``steps``
        points from ``baseline``: a token, default EOS, or "zeros") per prompt
        token of the ``target`` logit (None: the top next token), on ``s.twin()``."""
        return gradients.saliency(self, self.twin(), prompt, target, steps, baseline)

    @keywords
    def logit_attribution(self, prompts: Any, *, answer: Any, wrong: Any = None,
                          position: int = -1) -> Any:
        """Direct logit attribution (an ``Attribution``): embed, each layer's attn
        and mlp, each head and the biases' share of ``logit(answer) - logit(wrong)``
        after ``position``, the final norm's scale frozen (docs/methods.md)."""
        call = attribution.logit_attribution_call(self, prompts, answer, wrong, position)
        return self.run_call(call)

    # -- SAEs, and names on a server ----------------------------------------
    def sae(self, name: str) -> Any:
        """An SAE (:class:`~vlens.SAE`): on a connected session the server's
        ``name`` (``vlens serve --sae NAME=PATH``); locally a path or
        ``"toyworld-sae"``."""
        if self._runner.remote:
            return self.engine.sae(name)
        return server_names.local_sae(name, self.model)

    def register_vector(self, name: str, vector: Any) -> int:
        """Keep ``vector`` ``[width]`` on the server as ``name`` for this
        session's token (OpenAI bodies name it; again: replaced). Returns
        how many you hold. (Connected sessions only.)"""
        return server_names.server(self.engine, "s.register_vector").register_vector(
            name, vector)

    def register_preset(self, name: str, body: dict[str, Any]) -> str:
        """Keep ``body``, a ``vlens`` object, as preset ``name`` for this
        session's token; the base URL that applies it to every OpenAI call
        (docs/openai.md). (Connected sessions only.)"""
        engine = server_names.server(self.engine, "s.register_preset")
        engine.register_preset(name, body)
        return f"{engine.url}/presets/{name}/v1"

    # -- state and lifecycle --------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The workers' hook state (rank 0): ``records`` and ``plans``
        pending, ``edit_fns`` and ``vectors`` held, hooks and step counters."""
        return self.engine.rpc("vlens_status")[0]  # between two engine steps

    def close(self) -> None:
        """Cancel this session's calls still running (each ends with a
        ``ClosedError``), release its SAEs, twin and share of the engine,
        which shuts down with its last session. Harmless twice."""
        if self._twin is not None:
            self._twin = self._twin.release()
        self._runner.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_layers} layers, {self.info['impl']}"
        return f"Session({self.model!r}, {state})"

