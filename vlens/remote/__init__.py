"""One engine for many notebooks: ``vlens serve`` (server.py) and the
engine of ``vlens.connect``'s Session (client.py). Nothing on the client
side imports vLLM: a call's sampling settings cross as a dict (wire.py)."""
