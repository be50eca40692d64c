"""One engine for many notebooks: ``vlens serve`` (server.py) and the
engine of ``vlens.connect``'s Session (client.py). Nothing here imports
vLLM on the client side until a call builds its sampling settings."""
