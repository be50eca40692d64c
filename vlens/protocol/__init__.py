"""The plain data both processes share: the per-request plan (``plan``),
tensors as bytes (``tensors``), the named sites (``sites``) and the
architectures they are resolved from (``architectures``).

Imported by the notebook side and by the workers alike; imports neither.
"""
