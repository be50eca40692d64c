"""The plain data both processes share: the per-request plan (``plan``),
tensors as bytes (``tensors``), the named sites (``sites``), the
architectures they are resolved from (``architectures``) and the head
sites' tap on vLLM's Transformers backend (``head_tap``, a parameterless
module).

Imported by the notebook side and by the workers alike; imports neither.
"""
