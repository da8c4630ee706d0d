"""Typed errors. Library code raises these; only `rltool/commands/` turns them into exit codes.

Exit codes (every command): 0 success, 1 a check or gate failed, 2 usage or bad input,
3 a runtime failure (an engine died, a timeout).
"""

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_RUNTIME = 3


class RltoolError(Exception):
    """Base class. `exit_code` is what the CLI exits with; the message is one line naming the fix."""

    exit_code = EXIT_RUNTIME


class BadInputError(RltoolError):
    """Input the user gave is malformed or inconsistent (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(BadInputError):
    """A config file or flag value is invalid."""


class ShardSchemaError(BadInputError):
    """A rollout shard is missing, truncated, corrupt or does not follow the schema."""


class CheckpointError(BadInputError):
    """A weights directory or trainer checkpoint is missing, corrupt or mis-shaped."""


class TokenizerMismatchError(BadInputError):
    """Shards were produced with a different tokenizer than the one used to read them."""


class DeltaChainError(BadInputError):
    """A delta version does not apply: wrong base, missing link or checksum mismatch."""


class GateFailedError(RltoolError):
    """A check ran and failed (exit 1)."""

    exit_code = EXIT_CHECK_FAILED


class EngineError(RltoolError):
    """An engine died, answered with an error, or timed out (exit 3).

    `status_code` is the engine's HTTP status when it answered with an error, else None.
    """

    def __init__(self, message: str = "", *, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


class EngineTimeoutError(EngineError):
    """An engine call did not answer within its timeout."""


class RewardError(EngineError):
    """A reward function raised, or a reward-model server failed or answered garbage (exit 3)."""
