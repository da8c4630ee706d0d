"""The builtin engine's routes, one router per concern: generate (SGLang's /generate), openai
(/v1/...), info (health, readiness, model and server information), control (pause, continue,
abort, cache, memory), weights (updates from disk, version, pull), lora (LoRA adapters) and debug
(mounted on request).

Every route that changes the engine's state carries the `rltool.engine.security.ADMIN`
dependency where it is defined.
"""
