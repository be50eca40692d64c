"""Methods built on the Session's calls: activation patching (``patching``)."""
