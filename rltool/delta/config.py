"""Strict configs of the delta stage: one per `rltool delta` command (`DiffConfig`, `ApplyConfig`,
`VerifyConfig`, `PullConfig`) and `SyncConfig`, the weight-sync knobs that `train`/`loop` take
(`[sync]` table) and pass to `publish_version`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rltool.config import StageConfig, cli
from rltool.errors import ConfigError


class DiffConfig(StageConfig):
    base: str = Field(description="Full checkpoint the delta applies on.")
    new: str = Field(description="Full checkpoint the delta rebuilds.")
    out: str = Field(description="New directory for the delta version.")
    format: Literal["rltool", "slime"] = Field(
        "rltool", description="rltool: per-chunk sparse/xor/raw encodings (smaller); "
        "slime: slime's on-disk format, readable by a slime-patched SGLang.")
    encoding: Literal["xor", "overwrite"] = Field(
        "xor", description="slime format only: one encoding for every tensor.")
    workers: int | None = Field(None, ge=1, description="Encoder threads (default: CPU count, "
                                "at most 8).")
    version: int | None = Field(None, ge=1, description="Version of --new (default: its "
                                "rltool_version.json or weight_vNNNNNN name).")
    base_version: int | None = Field(None, ge=0, description="Version of --base (default: its "
                                     "rltool_version.json or weight_vNNNNNN name).")

    @model_validator(mode="after")
    def _encoding_needs_slime(self) -> "DiffConfig":
        if self.encoding == "overwrite" and self.format != "slime":
            raise ConfigError("--encoding overwrite is a slime-format encoding; add --format slime")
        return self


class ApplyConfig(StageConfig):
    base: str = Field(description="Full checkpoint the delta applies on.")
    delta: list[str] = Field(min_length=1, description="Delta directories of the chain, oldest "
                             "first.")
    out: str = Field(description="New directory for the rebuilt checkpoint.")
    workers: int | None = Field(None, ge=1, description="Decoder threads (default: CPU count, at "
                                "most 8).")


class VerifyConfig(StageConfig):
    path: str = Field(description="Delta or full checkpoint directory to check.",
                      json_schema_extra=cli(argument=True, metavar="PATH"))
    base: str | None = Field(None, description="For a delta: rebuild it on this checkpoint in "
                             "memory and check every checksum.")
    workers: int | None = Field(None, ge=1, description="Threads (default: CPU count, at most 8).")


class PullConfig(StageConfig):
    local: str = Field(description="Host-local checkpoint directory to bring up to date.")
    source: str = Field(description="Directory holding weight_vNNNNNN versions (full or delta).")
    version: int = Field(ge=0, description="Target version.")
    base_model: str | None = Field(None, description="Version 0 when --source has no "
                                   "weight_v000000.")
    workers: int | None = Field(None, ge=1, description="Decoder threads (default: CPU count, at "
                                "most 8).")


class SyncConfig(StageConfig):
    sync: Literal["full", "delta", "auto", "tensor", "distributed"] = Field(
        "full", description="How versions reach the engines: full checkpoints or deltas on the "
        "previous version (on disk), tensor (in memory through shared memory, colocated engines "
        "on this host), distributed (broadcast over a torch process group), or auto (tensor when "
        "engines and trainer share host and device, else full or delta by the cost model "
        "t = S/B + t0 with measured throughputs).")
    tensor_bucket_mb: int = Field(512, ge=1, description="tensor sync: bytes handed over per "
                                  "request, in MiB (the extra memory either side holds).")
    delta_format: Literal["rltool", "slime"] = Field("rltool", description="Delta format.")
    delta_encoding: Literal["xor", "overwrite"] = Field("xor", description="slime format encoding.")
    full_every: int = Field(10, ge=1, description="Publish a full version every M versions so "
                            "pull chains stay short.")
    link_bandwidth_gbps: float | None = Field(None, gt=0, description="Trainer-to-engine link "
                                              "bandwidth for auto (default: measured).")
    precision: Literal["bf16", "fp8", "int4"] | None = Field(
        None, description="Weights handed to the engines: bf16, fp8 (block-quantized "
        "128x128 e4m3 with float32 scales at every publish, the format of `rltool convert fp8`), "
        "or int4 (W4A16, re-quantized at every publish as `rltool convert int4` with its defaults "
        "for the model writes: groups of 32, symmetric, its default ignore list); default: the "
        "engines' dtype.")

    @model_validator(mode="after")
    def _quantized_transport(self) -> "SyncConfig":
        if self.precision in ("fp8", "int4") and self.sync == "distributed":
            raise ConfigError(f"--precision {self.precision} is not sent over --sync distributed "
                              "(the broadcast carries no scales); use --sync tensor, full or "
                              "delta")
        return self
