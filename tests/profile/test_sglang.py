"""SGLang deployment files: slime's --sglang-config layout, serving-reference.sh, and every rule's
error (nothing written when one fails)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rltool.cli import main as cli
from rltool.errors import BadInputError
from rltool.profile.sglang import config_yaml, pd_groups, serving_reference

EXPECTED = """sglang:
  - name: actor
    model_path: "/m"
    update_weights: true
    server_groups:
      - worker_type: prefill
        num_gpus: 4
        num_gpus_per_engine: 2
        overrides:
          enable_hierarchical_cache: true
      - worker_type: decode
        num_gpus: 8
        num_gpus_per_engine: 2
"""


def test_config_groups_sum_to_the_pool_with_hicache_on_prefill_only():
    groups = pd_groups(rollout_gpus=12, gpus_per_engine=2, gpus_per_node=8, prefill_engines=2,
                       hicache=True)
    assert config_yaml(groups, model_path="/m") == EXPECTED
    script = serving_reference(groups, model_path="/m", gpus_per_node=8)
    launches = [line for line in script.splitlines() if "sglang.launch_server" in line]
    assert len(launches) == 6
    assert sum("--enable-hierarchical-cache" in line for line in launches) == 2
    assert launches[4].startswith("CUDA_VISIBLE_DEVICES=0,1 ")  # engine 5 starts node 1
    assert "# node 1" in script
    router = next(line for line in script.splitlines() if "launch_router" in line)
    assert router.count("--prefill ") == 2 and router.count("--decode ") == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"engine_urls": ["http://h:1"]}, "external engine addresses"),
    ({"rollout_gpus": 7}, "not a multiple of --engine-tp"),
    ({"gpus_per_engine": 12, "rollout_gpus": 24}, "spans nodes"),
    ({"rollout_gpus": 2}, "at least one prefill and one decode"),
    ({"prefill_engines": 4}, "must leave at least one decode engine"),
    ({"prefill_engines": 0}, "must leave at least one decode engine"),
    ({"gpus_per_engine": 0}, "must be > 0"),
])
def test_every_rule_has_its_error(kwargs, message):
    args = {"rollout_gpus": 8, "gpus_per_engine": 2, "gpus_per_node": 8, "prefill_engines": 1,
            "hicache": False, **kwargs}
    with pytest.raises(BadInputError, match=message):
        pd_groups(**args)


def test_plan_writes_both_files_or_neither(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "vocab_size": 60}))
    out = tmp_path / "deploy" / "sglang.yaml"
    out.parent.mkdir()
    base = ["plan", "--model", str(config), "--gpus", "16", "--rollout-gpus", "8",
            "--engine-tp", "2", "--emit-sglang-config", str(out)]
    refused = CliRunner().invoke(cli, [*base, "--engine-urls", "http://h:1"])
    assert refused.exit_code == 2 and "external engine addresses" in refused.output
    refused = CliRunner().invoke(cli, [*base, "--prefill-engines", "4"])
    assert refused.exit_code == 2 and not any(out.parent.iterdir())
    ok = CliRunner().invoke(cli, [*base, "--mu-p-rps", "10", "--mu-d-rps", "5", "--json"])
    assert ok.exit_code == 0, ok.output
    text = out.read_text()
    # 4 engines, mu_P = 2 mu_D: the balanced split is 1 prefill, 3 decode
    assert "worker_type: prefill\n        num_gpus: 2\n" in text
    assert "worker_type: decode\n        num_gpus: 6\n" in text
    assert (out.parent / "serving-reference.sh").stat().st_mode & 0o111
