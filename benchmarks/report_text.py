"""The prose of docs/performance.md (report.py puts the run's numbers
around it). Facts measured while the benchmark was written are in DEV; every
other number in the doc comes from the JSON of a run."""

# Facts measured while this benchmark was written (py-spy profiles and a
# scratch prototype of the changes, on the 512 x 8 model, one torch thread);
# they explain the figures of a run, which are the ones in the tables.
DEV = {
    "token_strings_ms": 27, "convert_ids_ms": 1.2, "tokens": 4721,
    "h_hook_s": (4.79, 1.61), "h_run_s": (7.57, 4.57), "d_layout_s": (0.117, 0.049),
    "b_ratio_10": 1.001,
    # toy model, 10 interleaved repetitions: a trace whose plan reads and
    # writes nothing, as it is and with token text cached; and (c) the same
    "t0": 1.159, "t0_cached": 1.088, "c": 1.233, "c_cached": 1.143,
    # toy model, greedy without steering: vLLM and HF agree on this many of 32
    "unsteered_agree": 17,
}


LAYOUT_FIX = (
    "Done: the worker plans a step from the runner's arrays "
    "(`query_start_loc`, `num_computed_tokens`, the request ids) with numpy, not per "
    "request. Requests are grouped by plan once per batch (`BatchGroups`, "
    "vlens/worker/groups.py), kept while decode steps run the same requests in the same "
    "order; each group's rows come from array arithmetic (`np.repeat`/`np.arange`); a "
    "step's spans (`RowSpan`, a named tuple) are made only when something asks for "
    "them; and the per-request records are not touched inside the forward: each step "
    "leaves one `StepLog` (its arrays and its reads) in the worker's journal "
    "(vlens/worker/journal.py), replayed into per-request records when the client "
    "collects (requests reading `attn_pattern` keep their records in the forward: "
    "they need their keys every step). Each (site, layer)'s write index is one tensor "
    "built from those arrays. A decode step that runs the same batch one position "
    "further, with no request at the edge of a steering or set span, reuses the last "
    "step's plan whole (`plan_step(previous=...)`): its read and write indices are the "
    "same tensors for the whole decode run, and only the layout's positions are new. "
    "When one fixed vector and scale cover a run of rows (one Steer on a whole decode "
    "batch), the add is a slice add, not an indexed one. Left: the write index is not "
    "shared between layers whose writes are the same."
)


OPS_FIX = (
    "Done: in compiled mode the graph calls vlens's operator at every hooked (site, "
    "layer) of every step, planned or not (about 10 sites × 8 layers here). Declared "
    "with `torch.library.custom_op` each call cost ~10 µs of Python dispatch on this "
    "CPU; declared with a plain `torch.library.Library` and one kernel it costs "
    "~1.5 µs (vlens/worker/ops.py). That was most of the gap between (b*) and (a*)."
)


CLIENT_FIX = (
    "Done: `Session.token_strings` (vlens/session.py) caches each token's text per "
    "session. Decoding tokens one by one had cost "
    f"{DEV['token_strings_ms']} ms for one run's {DEV['tokens']:,} tokens (against "
    f"{DEV['convert_ids_ms']} ms for `convert_ids_to_tokens`), ~8 % of a toy-model run."
)


READS_FIX = (
    "Done: the requests reading a (site, layer) the same way in a step are gathered "
    "with one index the planner builds once per group of plans (shared by every site "
    "they read; a slice instead of a gather when a norm reads the whole decode batch "
    "in order), reduced once (a norm with `torch.linalg.vector_norm`, a copy, or one "
    "logit-lens matrix product), and kept as one tensor per (site, layer, step) in the "
    "step's log; `collect` cuts them per request after the run, not inside the "
    "forward pass. Left: reductions are not yet batched across layers."
)


COMPILED_TABLE_TEXT = """What users compare against is plain vLLM at its defaults: (a*) is a
`vllm.LLM(path)` with nothing of vlens in it, compiled (no `enforce_eager`),
with the same dtype, KV cache and `max_model_len` as the other engines, timed
in the same repetitions. The rows marked * run on a vlens Session with
`enforce_eager=False` (vlens compiled: its hooks are operators in vLLM's
compiled graph). The last column is the eager vlens run of the same
condition against (a*): what a user pays today if they keep to eager."""


FLOOR_TEXT = """The logit lens at every layer does arithmetic the model itself does not: for
each layer, every row of every step times the unembedding matrix. (h, floor)
times exactly those products alone, in this process, shaped as the engine's
steps (one prefill of every prompt token, then one [requests, hidden] ×
[hidden, vocabulary] product per decode step per layer). The floor of (h) is
(a) plus that time, the floor of (h*) is (a*) plus it, paired per
repetition; "to its floor" is the lens run divided by it. The lens also
normalises each row and takes its top-k; those are in the lens run, not in
the floor."""


SAE_TEXT = """Each token's 32 largest features of a 4096-wide SAE on `resid_post` of the
steering layer, every token of every request, prompt and generated:
`s.trace(prompts, saes=[sae], features_top_k=32, sites=[])`. The SAE is a
random standard SAE made on the spot in SAELens's format
(`benchmarks/hf_sae.py`; the values do not change the arithmetic). (sae)
runs on the eager engine, (sae*) on the compiled one, against plain vLLM at
its defaults (a*). (sae_hf) is the same encoding done the SAELens way: a
Hugging Face forward (`generate`, as (j)) with a hook on that layer that
encodes every row with the SAE and keeps its top 32. SAELens itself is not
installed in this environment (it pins its own torch), so the hook runs
SAELens's standard `encode` written out in torch,
`relu((x - b_dec) @ W_enc + b_enc)`: the same arithmetic, without the
library's bookkeeping. The last column is (sae_hf)'s time divided by the
row's, paired per repetition: how many times faster vlens gets the same
features."""


STEP_TEXT = """From the workers' counters (`layout_ns`, `hook_ns`, `steps_planned` in
`s.status()`), for one plan: `resid_pre`, `resid_post`, `attn_out` and
`mlp_out` read at layers {layers} (4 sites × 2 layers), reduced to norms in
the worker, {k_tokens} new tokens per request; once with the benchmark's
{prompts} prompts ("32" below) and once with {wide} requests (the prompts
cycled) in one engine batch (vLLM's default `max_num_seqs` on CPU is 256;
the KV cache of these engines is sized to hold them all).
Layout is µs per planned step; the per-site figure is hook time per planned
step divided by the 8 hooked sites. Each engine has two rows: every planned
step, and decode steps alone (`decode_*` in `s.status()`: one new row per
request, the steady state; the prefill steps of the wide batch read every
prompt token, thousands of rows). The next columns split the per-site
figure into the reads' own arithmetic (`reduce_ns`: making the value where a
site's value is a sum, `hidden + residual`, then the norm itself; both read
8× the rows at the wide batch) and the rest, vlens's work around it. The
goals are those for the wide batch. These conditions run in the first
repetitions only. `benchmarks/step_cost.py` measures the same split on its
own, with a control (see "The step cost (the design)")."""


PREAMBLE_TEXT = """On this CPU build vLLM's KV block is 128 tokens and only whole blocks are
cached, so the main table's prompts (7–33 words) never hit the prefix cache:
there, on and off differ only by the cache's bookkeeping. (p) puts one
shared preamble of a little over one block before each of the 32 prompts
and asks for a few new tokens, so most of the work is prefill that the
cache can skip; after the warm-up the cache holds the preamble's block.
Plain vLLM reuses it; a steer-only vlens trace reuses KV made under the same
steering (its `cache_salt`); a trace that reads recomputes the prompt so its
hooks see every row (`skip_reading_prefix_cache`). The ratio "to (p: a),
caching on" is what each costs next to plain vLLM with the cache. Like the
tables below and (k), these run in the first repetitions only."""


OFF_TEXT = """Earlier runs of this benchmark started every engine with
`enable_prefix_caching=False`. That setting is kept here as a second table on
its own engine (fewer conditions: plain, steering, reading; in the first
repetitions only, like (p) and (k)), so the figures stay comparable with the
old ones."""


INTRO = """\
# Performance

How much does looking inside a model with vlens cost, next to the same vLLM
engine without vlens, next to hooking a Hugging Face model, and next to
nnsight? Every number below comes from one run of `make bench`
(`.venv/bin/python benchmarks/run.py`) and is also in
[`benchmarks/results.json`](../benchmarks/results.json). Re-run it on your
machine; the file is rewritten.

## How it is measured

* **Throughput** of 32 prompts (7–33 words each) × 64 new tokens, greedy,
  EOS ignored, all 32 in one engine batch: tokens generated ÷ wall time of
  the whole call as a user makes it (`s.trace(...)` or `s.generate(...)`,
  including vlens's checks before the run and building the `Run` after).
* **Interleaved A/B in one process**: the engines of a model (below) are
  all started before any timing; every repetition runs every condition
  once, in an order rotated by one each repetition (the second tables, (p)
  and (k) in the first repetitions only). (a) is the same engine with vlens's hooks removed in place
  (`s.engine.rpc("vlens_teardown")`, then `"vlens_setup"` to put them back),
  so (a) and (b) differ only by the hooks. Each condition is warmed up
  (4 prompts × 4 tokens) before any timing.
* **Ratios are time ratios** (1.00 = as fast as the reference; 1.10 = 10 %
  slower), taken **per repetition** against the (a) or (a*) run of the
  same repetition, then the median (min–max) over repetitions. Pairing cancels
  most of the drift of a shared machine's load.
* **Engines as users run them**: prefix caching on (vLLM's default) for
  the main table. Per model up to four engines live in the one process,
  all with the same dtype (float32 as saved), KV cache and `max_model_len`,
  and vlens's environment defaults: (a*) a plain `vllm.LLM` at its defaults
  (compiled), a vlens Session in eager mode (the main table; (a) is it with
  the hooks removed), a vlens Session in compiled mode (`enforce_eager=False`,
  the rows marked *), and an eager vlens Session with
  `enable_prefix_caching=False` (the second table, the setting earlier runs
  used). With prompts this short the cache never hits in the main table
  (vLLM's CPU KV block is 128 tokens; only whole blocks are cached); (p) is
  the workload where it does.
* **One torch thread** for every tool on CPU (`OMP_NUM_THREADS=1`, unless
  set already). On this 2-core machine shared with other work, two OpenMP
  threads wait for each other at every parallel operation whenever another
  process holds a core: while this benchmark was written, plain vLLM ran the
  workload in ~35 s with 2 threads and ~2.5 s with 1, and single small
  operations (an `index_add_` of one prefill step) took milliseconds instead
  of microseconds. One thread keeps the comparison about vlens, not about
  the neighbours.
* **(j)** is transformers `generate` on the same weights and the same prompt
  token ids: one batch of 32, left padding, greedy, `min_new_tokens=64`, a
  forward hook on the same decoder layer adding the same vector to its
  output. **(m)** is nnsight 0.8 steering the same layer the same way
  (`model.model.layers[L].output[:] += v` for every forward pass of
  `generate`), in its own venv (`benchmarks/.venv-nnsight`, made on first
  run) and its own process, driven one run at a time so its runs interleave
  with the others.
* **(k)**: the worker counts, on rank 0, nanoseconds spent building each
  step's layout (`layout_ns`: which rows are whose, and the batched write
  index) and inside vlens's hook bodies (`hook_ns`), and the steps that had
  a plan (`steps_planned`). "In the worker hooks" is that time as a share of
  the run's wall time; "client side" is the wall time outside vLLM's
  `generate` call (checks, plans, collecting and decoding reads).
"""


GOALS_TEXT = """\
## Goals

Aims of the performance issues (not test assertions). Against (a), the
eager engine with the hooks removed: (b) ≤ 1.02, (c) ≤ 1.03, (d) ≤ 1.10,
(e) ≤ 1.05 × (c), (f) ≤ 1.10, (g) ≤ 1.05, (h) ≤ 1.10, and (j) slower than
(c). Against what users run, vlens compiled against (a*), plain
vLLM at its defaults: steering one layer (c*) ≤ 1.03, reading one layer
(f*) ≤ 1.05, norms at every layer (g*) ≤ 1.10; the logit lens at every
layer (h*) ≤ 1.10 × its arithmetic floor ((a*) plus the unembedding products
it must do); per step at the wide batch (4 sites × 2 layers, compiled):
layout ≤ 150 µs, ≤ 40 µs per hooked site, each within 1.5× of the figure at
32 requests. Each verdict below is the median of paired repetitions.
"""


def _compiled_mode() -> str:
    """The design of compiled mode, written by hand in docs/compiled-mode.md
    and copied here (its headings one level down) so the report is one page."""
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "compiled-mode.md"
    lines = doc.read_text().splitlines()
    body = [("#" + line if line.startswith("## ") else line) for line in lines[1:]]
    text = "\n".join(body).strip().replace("](performance.md)", "](#cpu-figures)")
    return "## Compiled mode (the design, from docs/compiled-mode.md)\n\n" + text + "\n"


COMPILED_MODE = _compiled_mode()


CLONE_TEXT = """\
## Clone reads (i), explained

What `trace` keeps for you (reads, the `Run`) is always a copy: the worker
copies each read to float32 CPU memory inside the hook, before any later
kernel can reuse the buffer, in both modes. So (f) with clone reads on and off
copies the same bytes (`run.copied_bytes`, below) and costs the same; the
ratio on/off is noise around 1.

`s.clone_reads` decides what code *inside the step* receives: an `edit=`
function gets a view of engine memory (off) or a copy (on). That is why (i)
is also measured with a trivial `edit=lambda rows, ctx: None` at one site:
with clone reads on, each call copies its request's rows once more
(`[rows, hidden]`, the last column of the table; vlens does not count these
bytes in `copied_bytes`). The difference is small here because vlens already
pays a copy per call in both modes: `_Hooks._run_edit` takes
`before = rows.clone()` and compares with `torch.equal` after the call, to
catch an in-place change that was not returned. Checking the tensor's version
counter instead (`v = rows._version` before, `rows._version != v` after: any
in-place write through the tensor or a view of it bumps it) would drop that
copy and comparison from every edit call, and leave clone reads as the only
copy.
"""


NNSIGHT_VLLM = (
    "nnsight's vLLM integration is written for vLLM's GPU worker: it builds its "
    "meta model through `torch.accelerator` and runs its own "
    "`NNsightGPUWorker`, a subclass of vLLM's CUDA `Worker`, so vLLM's CPU build "
    "cannot serve it (with the first error patched away, the next is vLLM's GPU "
    "worker refusing the device: `RuntimeError: Unsupported device type: cpu`). "
    "The GPU check (below) tries it again where it can run."
)


GPU_PENDING = """\
Pending: no GPU was lent to the session that made these figures. On a
machine with a CUDA GPU and vLLM's CUDA build, one command runs the GPU
check and adds its figures here (benchmarks/results-gpu.json):

```bash
.venv/bin/python benchmarks/run.py --device-check                 # makes a random 0.5B Qwen2-shaped model
.venv/bin/python benchmarks/run.py --device-check --model PATH    # or any local ~0.5B model
```

It runs the same conditions in bfloat16 with 3 repetitions (a few minutes
on one GPU); nnsight is included only if it is already installed there.
"""


NOISE = """\
## Reading these numbers

The CPU figures come from a 2-core machine shared with other work (see
"how busy the machine was" above): a run can be slowed by whatever else
runs in the same seconds, which is why every ratio is paired per
repetition and reported with its min–max. A ratio whose range straddles
the goal is a measurement that cannot tell; one whose whole range is past
it is a real miss. On a quiet machine re-run `make bench`.
"""


STEP_DESIGN = """## The step cost (the design)

What vlens does per engine step, and why it should not grow with the number
of requests in the batch:

* **Plan once per step, from the runner's arrays.** A pre-hook on the whole
  model reads vLLM's `query_start_loc`, `num_computed_tokens` and the
  batch's request ids, and `vlens.worker.planner.plan_step` turns them into one
  `StepPlan`: per (site, layer), the read groups (one index for every
  request reading it the same way), one batched add, one batched set, the
  edit calls. Requests are grouped by plan once per batch (`BatchGroups`),
  so the work is numpy arithmetic per group of plans, not Python per request.
* **Decode steps reuse the plan.** When a step runs the same batch one
  position further, one row per request, and no request stands on the edge
  of a steering or set span, `plan_step(previous=...)` keeps the last plan's
  index tensors and only makes a new layout. Through a decode run the
  indices are built once.
* **Hooks only execute.** At a (site, layer) a hook runs the plan's sets,
  its one add (a slice add when one fixed vector covers a run of rows, an
  `index_add_` otherwise), the edit calls, and each read group's gather and
  reduction (a slice when the rows are a run). The write path never reads a
  tensor back to the host (a test makes every host read raise inside the
  hooks).
* **Reads are kept per step, cut per request after the run.** Each
  reduction leaves one tensor per (site, layer, step) in the step's log
  (`vlens/worker/journal.py`); on a GPU the step's reads go to the host in
  one non-blocking copy per dtype into pinned memory at the end of the
  step. Per-request records are built when the client collects.
* **Compiled mode** calls one operator per hooked (site, layer) per step
  (below); each idle call costs one dispatch and one lookup.

What grows with the batch is the arithmetic of the reads themselves: a
norm over 256 rows reads 8× the bytes of one over 32. The per-step table
below therefore shows the hook time with and without the reads' own
arithmetic (`reduce_ns`), over every step and over decode steps alone.

**On this CPU the per-site goal is below the arithmetic's own cost.**
`benchmarks/step_cost.py` (command below; 512 × 8 model, compiled, one
thread, medians of 3, measured 2026-12-01), decode steps:

| | 32 requests | 256 requests | growth |
|---|---|---|---|
| µs / hooked site, all of it | 33 | 78 | 2.3× |
| of which the reads' arithmetic (sums, norms) | 21 | 52 | 2.5× |
| the rest: vlens's own work | 12 | 25 | 2.1× |
| control: `StepLog.put` alone, µs / call | 1.6 | 4.0 | 2.5× |
| control: a norm where it runs / run again at once, µs | 14 / 3.7 | 33 / 12 | |

* The sums and norms the (k) plan asks for cost ~52 µs per hooked site at
  256 requests on their own, above the goal of 40 µs all included. A norm
  run a second time at once on the same rows costs a third of its first
  run: the first touch of each operation after the model's layers pays for
  caches the layers' weights have just flushed. On a GPU the same
  reductions are a few µs and the fixed part dominates (`make gpu-check`
  prints this table with CUDA graphs).
* vlens's own part is the same Python and the same number of torch calls
  whatever the batch (the plan is made once per step from arrays and
  reused through decode), yet it takes ~2× as long at 256 requests. The
  control shows why: two plain assignments, timed alone at the same place,
  slow down as much (2.5× here; 1.5× in an earlier run). The wider batch's
  activations (an MLP intermediate of 256 × 1,536 floats is 1.5 MB) evict
  the interpreter's and the dispatcher's data between layers.

```bash
.venv/bin/python benchmarks/step_cost.py --model benchmarks/.models/llama-h512-l8 --compiled
```"""
