"""vlens's benchmark harness: ``python -m benchmarks --help`` (``make bench``, ``make report``).

conditions.py  the registry: each condition's readable name, table tag, engine, setup and measure
runner.py      the one interleaving runner; one JSONL line per measurement (+ the machine's facts)
results.py     results.jsonl -> paired ratios and worker figures; report.py + report.md -> the doc
tools.py, machine.py, nnsight_worker.py, clients.py: models and HF/SAE tools, machine facts,
nnsight's subprocess, the server clients (``serve``, ``openai``)
"""
