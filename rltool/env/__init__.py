"""Environments for agentic RL: the interface (`base.py`), the built-ins (`builtins.py`), the code
sandbox they run untrusted code in (`sandbox.py`), and `rltool env serve` (`server.py`, with its
client `remote.py`). docs/agentic.md."""
