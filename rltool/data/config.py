"""`rltool shards inspect` configuration (light: importing it loads no pyarrow)."""

from __future__ import annotations

from pydantic import Field

from rltool.config import StageConfig, cli


class ShardsInspectConfig(StageConfig):
    path: str = Field(description="Shard directory to validate and summarise.",
                      json_schema_extra=cli(argument=True, metavar="PATH"))
    tokenizer: str | None = Field(None, description="Model/tokenizer directory the shard must "
                                  "have been made with (hash check).")
