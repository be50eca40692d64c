"""vlens inside vLLM's compiled mode (``enforce_eager=False``).

In compiled mode vLLM traces the decoder stack once with torch.compile and
from then on runs the compiled code: a Python hook registered after that
never fires. Two things make vlens work there anyway:

* **hooks that exist before the trace.** The Engine asks vLLM for
  :class:`~vlens.worker.extension.CompiledCPUWorker` /
  :class:`~vlens.worker.extension.CompiledGPUWorker` (``worker_cls=``),
  vLLM's own worker with one change: right after the model is loaded, and
  before anything traces it, vlens installs its per-(site, layer) hooks;
* **hooks that only call an opaque operator.** Each of those hooks does
  nothing but call ``torch.ops.vlens.site(target, value, code)`` (or
  ``vlens.read`` on a read-only site). torch.compile keeps the operator as a
  call in the compiled graph, so it runs on every step, with the step's
  real tensors; its implementation, plain Python outside the graph, looks
  up the worker's current step plan and does exactly what the eager hook
  does (adds, edits, reads). ``target`` is declared mutated, so the graph
  uses the edited tensor downstream.

On a GPU, vLLM captures CUDA graphs; a Python operator inside a captured
graph would run once at capture and never again. The Engine therefore lists
both operators in ``compilation_config.splitting_ops`` (beside vLLM's own
attention operators) and asks for piecewise CUDA graphs: the graph is cut
at each vlens operator, the pieces between are captured, and the operators
run eagerly between them every step. See docs/performance.md.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SPLITTING_OPS", "compiled_hook", "register", "unregister"]

#: operators vLLM must split its compiled graph at (GPU, piecewise graphs)
SPLITTING_OPS = ["vlens::site", "vlens::read"]

# the hook states of the workers in this process; an operator call carries
# its worker's slot in the high bits of ``code``
_WORKERS: list[Any] = []
_SLOT_BITS = 20


def register(hooks: Any) -> int:
    """Give a worker's hook state a slot; returns the code base for its sites."""
    _WORKERS.append(hooks)
    return (len(_WORKERS) - 1) << _SLOT_BITS


def unregister(base: int) -> None:
    _WORKERS[base >> _SLOT_BITS] = None


def _dispatch(code: int, target: torch.Tensor | None, value: torch.Tensor) -> None:
    hooks = _WORKERS[code >> _SLOT_BITS]
    if hooks is not None:
        hooks.visit_compiled(code & ((1 << _SLOT_BITS) - 1), target, value)


# Declared with a plain ``torch.library.Library`` rather than
# ``torch.library.custom_op``: the graph calls these operators at every
# hooked (site, layer) of every step, planned or not, and custom_op's Python
# wrapper costs ~10 µs a call on this CPU against ~1.5 µs for a kernel
# registered directly (docs/performance.md: the step-cost conditions of
# ``python -m benchmarks``). The schemas say the same as before: ``site`` mutates ``target``, ``read``
# changes nothing (kept in the graph by ``has_side_effect`` below).
_LIB = torch.library.Library("vlens", "FRAGMENT")
_LIB.define("site(Tensor(a!) target, Tensor? value, int code) -> ()")
_LIB.define("read(Tensor value, Tensor? other, int code) -> ()")


def _site(target: torch.Tensor, value: torch.Tensor | None, code: int) -> None:
    """Run vlens's step plan at one writable (site, layer): ``target`` is
    the tensor edits are added to and, at a site whose value is a sum
    (``SiteSpec.addend``), ``value`` the part added to it (the worker sums
    them only if it must); None: the value is ``target`` itself."""
    _dispatch(code, target, value)


def _read(value: torch.Tensor, other: torch.Tensor | None, code: int) -> None:
    """Run vlens's step plan at one read-only (site, layer); ``other``: a
    second input of the site (``attn_pattern``'s keys beside its queries)."""
    _dispatch(code, None, value if other is None else (value, other))


# one Python kernel for every device (the plan's tensors live where the model does)
_LIB.impl("site", _site, "CompositeExplicitAutograd")
_LIB.impl("read", _read, "CompositeExplicitAutograd")


@torch.library.register_fake("vlens::site", lib=_LIB)
def _(target, value, code) -> None:
    return None


@torch.library.register_fake("vlens::read", lib=_LIB)
def _(value, other, code) -> None:
    return None


# an operator with no output and no mutation would be removed as dead code
torch.fx.node.has_side_effect(torch.ops.vlens.read.default)

def compiled_hook(spec: Any, code: int, pre: bool):
    """The hook torch.compile traces into the graph: compute the site's
    target and value, and hand them to the operator. Nothing else: any
    Python branch here would be frozen at trace time."""

    def call(args: tuple, kwargs: dict, output: Any) -> None:
        # nothing computed here for vlens alone: the graph runs this every
        # step, traced or not (a sum such as hidden + residual is left to
        # the worker, which makes it only when a read or an edit needs it)
        if spec.target is None:
            value = spec.extract(args, kwargs, output)
            if isinstance(value, tuple):  # attn_pattern's (q, k)
                torch.ops.vlens.read(value[0], value[1], code)
            else:
                torch.ops.vlens.read(value, None, code)
            return
        target = spec.target(args, kwargs, output)
        # the value is the target itself, or the target plus the addend
        # (the worker refuses any other writable site at install)
        addend = spec.addend(args, kwargs, output) if spec.addend is not None else None
        torch.ops.vlens.site(target, addend, code)

    if pre:
        return lambda module, args, kwargs: call(args, kwargs, None)
    return lambda module, args, kwargs, output: call(args, kwargs, output)
