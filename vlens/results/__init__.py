"""What a Session's calls return: plain holders, no engine.

``Run`` / ``Trace`` (``run.py``: ``trace``, ``stream``, ``generate``),
``Comparison`` / ``Sweep`` (``steering.py``: ``compare``, ``sweep``) and
``Patching`` (``patching.py``: ``patch``; imported from there, or as
``vlens.Patching``).
"""

from vlens.results.run import Run, Trace
from vlens.results.steering import Comparison, Sweep, generated_kl, kl_per_position, run_label

__all__ = ["Comparison", "Run", "Sweep", "Trace", "generated_kl", "kl_per_position",
           "run_label"]
