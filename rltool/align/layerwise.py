"""Layerwise gate: where do the engine's and the trainer's forward passes start to differ?

For each chosen sample (the gate's worst ones) both sides run one unpadded forward over prompt +
response with `output_hidden_states=True`: the engine through its debug endpoint
(rltool.engine.routes.debug, `rltool serve --enable-debug-endpoints`), the trainer with the torch
backend's model built from the weights directory, under the trainer's dtype (bf16 = autocast over
fp32 weights, as training runs). Entries, in forward order:

  embed_tokens            transformers' hidden_states[0] (the input embeddings)
  layers.0 ... layers.N-1 the output of each decoder layer; transformers applies the final norm to
                          the last one, so layers.N-1 also covers model.norm
  lm_head                 log p(token t | tokens < t) at temperature 1 (the output projection)

For each entry: max and mean |engine - trainer| over the chosen samples, and the first entry whose
max exceeds the tolerance -- the layer where a weight, kernel or layout difference first shows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltool.engine import api
from rltool.errors import BadInputError, EngineError, EngineTimeoutError

if TYPE_CHECKING:
    import torch

    from rltool.align.gate import SampleRef

log = logging.getLogger(__name__)


def layer_names(num_hidden_states: int) -> list[str]:
    """Names of transformers' hidden_states entries (embeddings, then one per decoder layer)."""
    return ["embed_tokens"] + [f"layers.{i}" for i in range(num_hidden_states - 1)]


def engine_hidden_states(url: str, token_ids: list[int], *, api_key: str | None = None,
                         timeout_s: float = 120.0) -> dict[str, Any]:
    """POST /debug/hidden_states to one engine; a clear error when the route is not mounted."""
    import httpx

    endpoint = url.rstrip("/") + api.DEBUG_HIDDEN_STATES
    # Unvalidated here: the engine judges the body and answers 400 with the reason.
    body = api.HiddenStatesInput.model_construct(input_ids=list(token_ids)).body()
    try:
        response = httpx.post(endpoint, json=body, headers=api.bearer(api_key),
                              timeout=timeout_s)
    except httpx.TimeoutException as e:
        raise EngineTimeoutError(f"POST {endpoint}: no answer within {timeout_s:g}s") from e
    except httpx.HTTPError as e:
        raise EngineError(f"POST {endpoint}: cannot reach the engine ({type(e).__name__}: "
                          f"{e})") from e
    if response.status_code == 404:
        raise BadInputError(f"engine {url} has no {api.DEBUG_HIDDEN_STATES}; start it with "
                            "`rltool serve --enable-debug-endpoints` (builtin engine only)")
    if response.status_code >= 400:
        raise EngineError(f"POST {endpoint} answered {response.status_code}: "
                          f"{response.text[:500]}", status_code=response.status_code)
    return response.json()


class TrainerModel:
    """The trainer's model for these weights, as the torch backend builds it (no optimizer)."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "fp32", device: str = "cpu"):
        from rltool.train.config import BackendConfig
        from rltool.train.torch_backend import TorchBackend

        self.backend = TorchBackend(model_dir, options=BackendConfig(dtype=dtype, device=device),
                                    trainable=False)
        self.backend.inner.eval()

    def hidden_states(self, token_ids: list[int]) -> tuple[list["torch.Tensor"], "torch.Tensor"]:
        """(hidden states per entry [T, H] float64, token logprobs [T-1] float64)."""
        import torch

        from rltool.logprobs import logits_to_logprobs

        ids = torch.tensor([token_ids], dtype=torch.long, device=self.backend.device)
        with torch.no_grad(), self.backend._autocast():
            out = self.backend.inner(input_ids=ids, use_cache=False, output_hidden_states=True)
        logprobs = logits_to_logprobs(out.logits[0, :-1], ids[0, 1:], temperature=1.0)
        return ([h[0].double().cpu() for h in out.hidden_states], logprobs.double().cpu())


def compare_layers(samples: list["SampleRef"], *, model_dir: str | Path, engine_url: str,
                   dtype: str = "fp32", tol: float = 1e-6, api_key: str | None = None,
                   timeout_s: float = 120.0, device: str = "cpu") -> dict[str, Any]:
    """Per-entry diffs between the engine and the trainer model over `samples` (module docstring).

    Returns {"tol", "samples": [uid], "engine_weight_version", "layers": [{name, max_abs_diff,
    mean_abs_diff}], "first_layer_above_tol": name or None}.
    """
    import torch

    model = TrainerModel(model_dir, dtype=dtype, device=device)
    names: list[str] | None = None
    max_diff: list[float] = []
    sums: list[float] = []
    counts: list[int] = []
    engine_version = None
    for s in samples:
        answer = engine_hidden_states(engine_url, s.token_ids, api_key=api_key,
                                      timeout_s=timeout_s)
        engine_version = answer.get("weight_version")
        engine = [torch.tensor(h, dtype=torch.float64) for h in answer["hidden_states"]]
        engine.append(torch.tensor(answer["token_logprobs"], dtype=torch.float64))
        mine, logprobs = model.hidden_states(s.token_ids)
        mine.append(logprobs)
        if len(engine) != len(mine) or any(a.shape != b.shape for a, b in zip(engine, mine)):
            raise BadInputError(
                f"engine {engine_url} returned hidden states of shapes "
                f"{[list(t.shape) for t in engine]}, the trainer model "
                f"{[list(t.shape) for t in mine]}: the engine serves another architecture")
        if names is None:
            names = layer_names(len(mine) - 1) + ["lm_head"]
            max_diff, sums, counts = [0.0] * len(names), [0.0] * len(names), [0] * len(names)
        for k, (a, b) in enumerate(zip(engine, mine)):
            d = (a - b).abs()
            max_diff[k] = max(max_diff[k], float(d.max()) if d.numel() else 0.0)
            sums[k] += float(d.sum())
            counts[k] += d.numel()
    assert names is not None, "compare_layers needs at least one sample"
    layers = [{"name": n, "max_abs_diff": m, "mean_abs_diff": s / max(c, 1)}
              for n, m, s, c in zip(names, max_diff, sums, counts)]
    first = next((layer["name"] for layer in layers if not layer["max_abs_diff"] <= tol), None)
    if first is not None:
        log.info("layerwise: first entry above %g is %s", tol, first)
    return {"tol": tol, "samples": [s.uid for s in samples],
            "engine_weight_version": engine_version, "layers": layers,
            "first_layer_above_tol": first}
