"""The notebook's handle on a live engine.

A ``Session`` holds (a share of) one :class:`~vlens.engine.Engine`. Each of
its calls does the same three things: check every input
(:mod:`vlens.checks`), build one request per prompt, each carrying a small
plan, and hand them to its runner (:mod:`vlens._runner`), which runs them in
one engine batch and turns what the workers read into
:class:`~vlens.results.Run` objects. The steering workflows (``direction``,
``compare``, ``sweep``) are methods here like ``trace``. Widgets and
notebooks use only this API.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from vlens import checks
from vlens.methods import ablation, directions, patching, sae
from vlens._runner import Runner, env_flag, live_engines
from vlens.engine.engine import start_options
from vlens.engine.quiet import start_line
from vlens.engine.startup import resolve_model
from vlens.errors import VlensError
from vlens.protocol.plan import Edit, Read
from vlens.results import Comparison, Run, Sweep, generated_kl, run_label
from vlens.calls import Call, TraceParams
from vlens.edits import Ablate, Steer
from vlens.prompts import Prompt, edits_each, normalise, resolve_roles
from vlens.methods.server_names import ServerNamed

__all__ = ["Session", "live_engines"]


class Session(ServerNamed):
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
    def _attach(cls, engine: Any) -> Session:
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

    def prompts(self, prompts: Any) -> list[Prompt]:
        """Prompts of any form (a string, a conversation, token ids, or a
        list of these) as :class:`~vlens.prompts.Prompt` objects: the ids the
        engine runs, the formatted text, offsets and per-token roles."""
        return normalise(prompts, self.tokenizer, self._facts.max_model_len,
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

    @property
    def n_layers(self) -> int:
        return self._facts.n_layers

    @property
    def hidden_size(self) -> int:
        return self._facts.hidden_size

    @property
    def sites(self) -> list[str]:
        return list(self._facts.sites)

    @property
    def max_model_len(self) -> int:
        return self._facts.max_model_len

    @property
    def _facts(self) -> checks.ModelFacts:
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
    def trace(
        self, prompts: str | Sequence[str], *,
        layers: int | Sequence[int] | None = None,
        sites: str | Sequence[str] = ("resid_post",),
        max_new_tokens: int = 16,
        logprobs: bool = True, background: Sequence[str] = (),
        steer: Any = None,
        ablate: Any = None,
        edit: Any = None,
        edit_at: Sequence[tuple[str, int]] | None = None,
        reduce: str = "full",
        logit_lens: int = 0,
        heads: int | Sequence[int] | None = None,
        saes: Any = None,
        features_top_k: int = 0,
        clamp: Any = None,
        progress: Any = None,
        **sampling: Any,
    ) -> Run:
        """Generate from each prompt and read ``sites`` at ``layers``.

        Greedy unless sampling settings (``temperature``, ``n`` …: vLLM's
        ``SamplingParams``) say otherwise. One engine batch; each request
        reads and writes only its own rows. A :class:`~vlens.results.Run`,
        one trace per request (``n`` per prompt when ``n > 1``).

        * ``steer``: a :class:`~vlens.Steer` or a list of them (all on every
          prompt), or ``vlens.PerPrompt([...])`` (one entry per prompt: a
          Steer, a list of Steers, or None);
        * ``ablate``: a :class:`~vlens.Ablate`, a list of them, or
          ``vlens.PerPrompt([...])``: zero or mean-replace a site (or heads
          of ``z``), batched like steering (see docs/methods.md);
        * ``edit``: ``fn(rows, ctx) -> rows | None`` called with one
          request's rows (``[n, hidden]`` or ``[1, n, hidden]``) at each
          ``edit_at`` (site, layer) pair, every step; return the edited
          tensor (an in-place change that is not returned is an error), or
          None to only look. The rows are a copy when ``clone_reads`` is on,
          else a view of engine memory valid only during the call. Runs in
          the worker (in-process engines; see docs/steering.md);
        * ``reduce``: ``"full"`` (default) or ``"norm"`` (the worker ships
          only norms); ``logit_lens=k`` also reads the logit lens top-k of
          ``resid_post`` at ``layers``, computed in the worker;
        * ``heads``: the query heads an ``attn_pattern`` read computes (None:
          all); the pattern costs ``heads x T x T`` floats per layer, so
          pick heads (and layers) for long prompts;
        * ``saes``: a :class:`~vlens.SAE` or a list: each encodes its site at
          its layer in the worker (``t.features(sae)``, ``[T, d_sae]``);
          ``features_top_k=k`` ships only each token's k largest; ``clamp``:
          a :class:`~vlens.Clamp` (a list, or ``PerPrompt``) sets a feature;
        * ``background``: prompts run in the same batch with no plan, as
          other users' traffic would (``run.background_texts``);
        * ``progress``: True for a progress bar, or ``fn(done, total)``
          called as requests finish (raising in it stops the run cleanly).

        A steer on generated tokens that covers none (the request stopped
        at its first token) is recorded (``steered_rows == 0``) with a
        :class:`~vlens.errors.VlensWarning` naming the prompts.
        """
        params = TraceParams(
            layers=layers, sites=sites, max_new_tokens=max_new_tokens, logprobs=logprobs,
            background=background, steer=steer, ablate=ablate, edit=edit, edit_at=edit_at,
            reduce=reduce, logit_lens=logit_lens, heads=heads, saes=saes,
            features_top_k=features_top_k, clamp=clamp, sampling=sampling)
        return self._runner.run(self._trace_call(prompts, params), budget=self.read_budget,
                                progress=progress)

    def stream(self, prompts: str | Sequence[str], *, progress: Any = None,
               **options: Any) -> Iterator[Run]:
        """``trace``, token by token, with the same keywords: after every
        engine step a partial Run (tokens and text so far, no reads), last
        the finished Run exactly as ``trace`` returns it. Closing the
        iterator early aborts the requests and leaves the engine clean."""
        return self._runner.stream(self._trace_call(prompts, TraceParams.of(**options)),
                                   budget=self.read_budget, progress=progress)

    def _trace_call(self, prompts: str | Sequence[str], params: TraceParams) -> Call:
        """Check a trace's arguments and build its call (which streams too)."""
        facts = self._facts
        layers, sites, max_new_tokens = params.layers, params.sites, params.max_new_tokens
        logprobs, sampling, m = params.logprobs, params.sampling, params.max_new_tokens
        plist = self.prompts(prompts)
        prompts, prompt_ids = [p.label for p in plist], [p.ids for p in plist]
        layers = checks.check_layers(layers, facts)
        sites = checks.check_sites(sites, facts)
        reads = checks.check_reads(sites, layers, params.reduce, params.logit_lens, facts,
                                   checks.check_heads(params.heads, sites, facts))
        reads += sae.feature_reads(params.saes, params.features_top_k, facts, self._runner)
        checks.check_generation(max_new_tokens, sampling, facts)
        lens = [len(ids) for ids in prompt_ids]
        steers_each = sae.with_clamps(
            checks.check_steers(edits_each(params.steer, plist, Steer, max_new_tokens=m), lens,
                                m, facts), params.clamp,
            checks.check_steers(edits_each(params.clamp, plist, Steer, max_new_tokens=m), lens,
                                m, facts))
        ablates = edits_each(params.ablate, plist, Ablate, resolve=False)
        ablates = ablation.check_ablates(ablates, facts, lens, max_new_tokens)
        pairs = checks.check_edit(params.edit, params.edit_at, facts,
                                  can_ship=self._runner.can_ship_functions,
                                  remote=self._runner.remote)
        bg_ids = []
        if params.background:
            bg_ids = [p.ids for p in self.prompts(list(params.background))]
        ablates = ablation.fill_means(self, [p.source for p in plist], ablates)  # may read once
        ablates = [resolve_roles(a, p, i, m) for i, (a, p) in enumerate(zip(ablates, plist))]
        fid = f"fn-{uuid.uuid4().hex[:12]}"
        edits = [Edit(site, layer, fid) for site, layer in pairs]
        call = self._runner.next_call()
        requests = [
            self._runner.request(f"{call}-{i}", i, ids, reads=reads, steers=steers, edits=edits,
                                 max_new_tokens=max_new_tokens, logprobs=logprobs,
                                 sampling=sampling, clone=self.clone_reads,
                                 source=p, **ablation.plan_parts(abl, len(ids), facts.head_dim))
            for i, (ids, steers, abl, p)
            in enumerate(zip(prompt_ids, steers_each, ablates, plist))
        ]
        requests += [self._runner.background(ids, max_new_tokens, sampling) for ids in bg_ids]
        n = len(prompts)

        def assemble(outputs: list, collected: dict) -> Run:
            run = self._runner.build_run(prompts, requests[:n], outputs[:n], collected, logprobs)
            run.background_texts = [o.outputs[0].text for o in outputs[n:]]
            return run

        return Call(requests, assemble,
                    partial=lambda outs: self._runner.partial_run(prompts, requests[:n], outs[:n]),
                    edit_fns={fid: params.edit} if edits else {})

    def generate(self, prompts: str | Sequence[str], *, max_new_tokens: int = 16,
                 **sampling: Any) -> list[str]:
        """Plain generation with no plan (the hooks stay idle): the texts."""
        plist = self.prompts(prompts)
        checks.check_generation(max_new_tokens, sampling, self._facts)
        requests = [self._runner.background(p.ids, max_new_tokens, sampling) for p in plist]
        return self._runner.run(Call(requests, lambda outs, _: [o.outputs[0].text for o in outs]),
                                budget=self.read_budget)

    # -- steering workflows ---------------------------------------------------
    def direction(self, positive: Sequence[str], negative: Sequence[str], *, layer: int,
                  site: str = "resid_post", position: str = "last",
                  progress: Any = None) -> torch.Tensor:
        """Difference of means: ``mean(positive) - mean(negative)`` of ``site``
        at ``layer``, ``[hidden]`` float32 (at ``z``: ``[heads * head_dim]``,
        flat, as a Steer there takes it). ``position="last"`` takes each
        prompt's last token, ``"mean"`` the mean over its tokens (the BOS row,
        the same for every prompt, left out)."""
        return directions.difference_of_means(self, self._facts, positive, negative,
                                              layer=layer, site=site, position=position,
                                              progress=progress)

    def compare(self, prompts: str | Sequence[str], *, steer: Any, max_new_tokens: int = 16,
                progress: Any = None, **sampling: Any) -> Comparison:
        """Baseline and steered generations of the same prompts in ONE engine
        batch: both texts, per-token logprobs, KL per position, first
        divergence. ``steer`` takes the same forms as in ``trace``."""
        plist, arms = self._compare_arms(prompts, steer, max_new_tokens, sampling)
        call = self._steering_call(plist, arms, max_new_tokens, sampling)
        runs = self._runner.run(call, budget=self.read_budget, progress=progress)
        return _comparison(*runs, steer)

    def stream_compare(self, prompts: str | Sequence[str], *, steer: Any,
                       max_new_tokens: int = 16, progress: Any = None,
                       **sampling: Any) -> Iterator[Any]:
        """``compare``, token by token: after every engine step a pair of
        partial Runs ``(baseline, steered)`` (tokens and text so far), and
        last the finished :class:`~vlens.results.Comparison`, exactly as
        ``compare`` returns it. Closing the iterator early aborts the run."""
        plist, arms = self._compare_arms(prompts, steer, max_new_tokens, sampling)
        call = self._steering_call(plist, arms, max_new_tokens, sampling)
        assemble = call.assemble
        call.assemble = lambda outs, got: _comparison(*assemble(outs, got), steer)
        return self._runner.stream(call, budget=self.read_budget, progress=progress)

    def _compare_arms(self, prompts, steer, max_new_tokens, sampling):
        facts = self._facts
        plist = self.prompts(prompts)
        checks.check_generation(max_new_tokens, sampling, facts)
        steers_each = checks.check_steers(edits_each(steer, plist, Steer),
                                          [len(p.ids) for p in plist], max_new_tokens, facts)
        if not any(steers_each):
            raise VlensError("compare needs a steer= (nothing would differ)")
        return plist, [("b", [[] for _ in plist]), ("s", steers_each)]

    def sweep(self, prompt: str, *, steer: Steer, scales: Sequence[float],
              max_new_tokens: int = 16, progress: Any = None, **sampling: Any) -> Sweep:
        """``steer`` at each of ``scales`` on one prompt, all in ONE batch
        (plus an unsteered baseline when 0 is not among the scales)."""
        plist = self.prompts(prompt)
        if len(plist) != 1:
            raise VlensError(f"sweep takes one prompt, got a batch of {len(plist)}")
        if not isinstance(steer, Steer):
            raise VlensError("sweep takes one vlens.Steer as steer=")
        if not isinstance(scales, (list, tuple)) or not scales:
            raise VlensError("scales must be a non-empty list of numbers")
        bad = [x for x in scales if isinstance(x, bool) or not isinstance(x, (int, float))]
        if bad:
            raise VlensError(f"scales must be numbers; {bad[0]!r} is not")
        scales = [float(x) for x in scales]
        variants = [steer.with_scale(x) for x in scales]  # validates each
        facts = self._facts
        checks.check_generation(max_new_tokens, sampling, facts)
        variants = [resolve_roles([st], plist[0], 0, max_new_tokens) for st in variants]
        for st in variants[0]:
            checks.check_steer(st, facts, len(plist[0].ids), max_new_tokens)
        plain = getattr(steer, "sae", None) is None  # a Clamp to 0 writes: not the baseline
        arms = [(str(j), [[] if plain and sts[0].scale == 0 else sts])
                for j, sts in enumerate(variants)]
        if not plain or 0.0 not in scales:
            arms.append(("base", [[]]))
        call = self._steering_call(plist, arms, max_new_tokens, sampling)
        prompt = plist[0].label
        runs = self._runner.run(call, budget=self.read_budget, progress=progress)
        traces = [run[0] for run in runs]
        baseline = traces[scales.index(0.0)] if plain and 0.0 in scales else traces[-1]
        steered = Run(traces[: len(scales)], prompts=[prompt] * len(scales))
        return Sweep(prompt, scales, steered, baseline,
                     [generated_kl(baseline, t) for t in steered])

    def _steering_call(self, plist: list[Prompt],
                       arms: list[tuple[str, list[list[Steer]]]], max_new_tokens: int,
                       sampling: dict[str, Any]) -> Call:
        """Every arm (a name and the steers of each prompt) over ``prompts``
        for ONE batch, each request reading the last layer's logprobs: its
        assemble makes one Run per arm, its partial one partial Run per arm."""
        reads = [Read("resid_post", (self.n_layers - 1,), "logprobs")]
        prompts = [p.label for p in plist]
        call = self._runner.next_call()
        requests = [
            self._runner.request(f"{call}-{arm}{i}", i, p.ids, reads=reads, steers=steers,
                                 max_new_tokens=max_new_tokens, logprobs=True,
                                 sampling=sampling, clone=self.clone_reads, source=p)
            for arm, arm_steers in arms
            for i, (p, steers) in enumerate(zip(plist, arm_steers))
        ]
        n = len(prompts)

        def assemble(outputs: list, collected: dict) -> list[Run]:
            return [self._runner.build_run(prompts, requests[k:k + n], outputs[k:k + n],
                                           collected, True)
                    for k in range(0, len(requests), n)]

        def partial(outputs: list) -> tuple[Run, ...]:
            return tuple(self._runner.partial_run(prompts, requests[k:k + n], outputs[k:k + n])
                         for k in range(0, len(requests), n))

        return Call(requests, assemble, partial=partial)

    # -- methods: patching ---------------------------------------------------
    def patch(self, clean: str, corrupt: str, *, site: str = "resid_post", layers: Any = None,
              positions: Any = None, answer: Any = None, heads: bool = False,
              progress: Any = None) -> patching.Patching:
        """Activation patching: for every (layer, position) cell, the clean
        run's ``site`` row written into the corrupt run; ``.grid``
        ``[layers, positions]`` of the normalised logit difference (1: the
        clean answer restored, 0: the corrupt run's). ``answer=(clean,
        corrupt)`` token texts or ids; None: each run's top next token.
        ``site="z", heads=True``: one cell per (layer, head) over all
        ``positions`` (``[layers, heads]``). Two engine calls: one reads
        the clean and corrupt runs, one runs every cell as its own request
        (see docs/methods.md); ``progress`` counts the requests of both."""
        return patching.run_patch(self, clean, corrupt, site, layers, positions, answer, heads,
                                  progress=progress)

    def stream_patch(self, clean: str, corrupt: str, *, site: str = "resid_post",
                     layers: Any = None, positions: Any = None, answer: Any = None,
                     heads: bool = False, progress: Any = None
                     ) -> Iterator[patching.Patching]:
        """``patch``, filling in: after every engine step a Patching with NaN
        where a cell has not finished; the last item equals ``patch``'s."""
        return patching.stream_patch(self, clean, corrupt, site, layers, positions, answer,
                                     heads, progress=progress)

    # -- state and lifecycle --------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The workers' hook state (rank 0): ``records`` and ``plans``
        pending, ``edit_fns`` and ``vectors`` held, hooks and step counters."""
        with self.engine.lock:  # a run under way (a widget's) ends first
            return self.engine.rpc("vlens_status")[0]

    def close(self) -> None:
        """Release this session's share of the engine; the engine shuts down
        when its last session closes. Calling it twice is harmless."""
        self._runner.release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_layers} layers, {self.info['impl']}"
        return f"Session({self.model!r}, {state})"


def _comparison(base: Run, steered: Run, edits: Any) -> Comparison:
    kl, label = [generated_kl(b, s) for b, s in zip(base, steered)], run_label(edits)
    return Comparison(base, steered, kl, label=label)
