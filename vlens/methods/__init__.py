"""The call builders behind the Session's methods: each turns one method's
checked arguments into one :class:`vlens.calls.Call` (in stages when it
needs several engine batches), using only the Session's public surface
(``traces``, ``steering``, ``patching``, ``ablation``, ``directions``,
``sae``, ``server_names``)."""
