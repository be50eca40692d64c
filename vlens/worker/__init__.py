"""What runs inside vLLM's worker processes.

``extension.VlensWorkerExtension`` is what ``vllm.LLM(worker_extension_cls=...)``
mixes into vLLM's worker; the rest is the hook state it drives: the pure
step planner (``planner``, ``groups``, ``layout``), the hooks and what they
do at one (site, layer) (``hooks``, ``site_ops``, ``head_sites``,
``attention``), compiled mode's operators (``ops``), the steering vectors
(``vectors``) and what a request read (``records``, ``journal``,
``collect``).

Nothing here imports the notebook side (the session, the runner, checks,
widgets, plots, remote, the engine); it imports only :mod:`vlens.protocol`,
:mod:`vlens.errors` and torch (``tests/test_layers.py`` says so).
"""
