"""`rltool doctor`: versions as the packages report them, the tiers and their reasons, missing
and broken packages."""

from __future__ import annotations

import importlib.util
import json

import torch
from click.testing import CliRunner

from rltool import doctor, native
from rltool.cli import main


def test_doctor_json_matches_this_machine():
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    packages = report["packages"]
    assert packages["torch"] == {"version": torch.__version__, "status": "ok"}
    if importlib.util.find_spec("ray") is None:
        assert packages["ray"] == {"version": None, "status": "not installed"}
    else:
        import ray

        assert packages["ray"] == {"version": ray.__version__, "status": "ok"}
    assert report["native_kernels"]["built"] == (native.library_path() is not None)
    assert report["tiers"]["cpu"]["ok"] is True
    assert report["cuda"]["torch_cuda"] == torch.version.cuda
    if not torch.cuda.is_available():
        assert report["cuda"]["devices"] == []
        for tier in ("gpu", "sglang"):
            assert report["tiers"][tier]["ok"] is False
            assert "no CUDA GPU" in report["tiers"][tier]["why"]
    else:
        assert len(report["cuda"]["devices"]) == torch.cuda.device_count()
        assert report["cuda"]["devices"][0]["memory_gib"] > 0


def test_doctor_table_names_every_tier():
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    for word in ("torch", "megatron-core", "transformer-engine", "ray", "native kernels",
                 "cpu", "gpu", "megatron", "sglang", "rltool[sglang]"):
        assert word in result.stdout


def test_missing_and_broken_packages(tmp_path, monkeypatch):
    (tmp_path / "rltool_doctor_broken.py").write_text("raise ImportError('needs libfoo.so')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert doctor.package_status("rltool-no-such-dist", "rltool_no_such_module") == {
        "version": None, "status": "not installed"}
    status = doctor.package_status("rltool-doctor-broken", "rltool_doctor_broken")
    assert status == {"version": None, "status": "broken: ImportError: needs libfoo.so"}


def test_tiers_say_why_and_how_to_fix():
    ok = {"version": "1.0", "status": "ok"}
    missing = {"version": None, "status": "not installed"}
    packages = {name: ok for name in doctor.PACKAGES} | {"sglang": missing,
                                                         "megatron-core": missing}
    no_cuda = {"torch_cuda": None, "available": False, "devices": [],
               "reason": "torch 2.x is a CPU-only build"}
    tiers = doctor.tiers(packages, no_cuda)
    assert tiers["cpu"]["ok"] and not tiers["gpu"]["ok"]
    assert tiers["megatron"] == {"ok": False, "why": "megatron-core not installed; install it "
                                 "with pip install 'rltool[megatron]'"}
    assert tiers["sglang"]["why"] == ("sglang not installed; install it with pip install "
                                      "'rltool[sglang]'; no CUDA GPU: torch 2.x is a CPU-only "
                                      "build")
    one_gpu = {"torch_cuda": "12.8", "available": True, "reason": None,
               "devices": [{"index": 0, "name": "H200", "memory_gib": 139.8,
                            "capability": "9.0"}]}
    tiers = doctor.tiers({name: ok for name in doctor.PACKAGES}, one_gpu)
    assert all(t["ok"] for t in tiers.values())
    assert tiers["sglang"]["why"] == "sglang 1.0 on 1 GPU(s)"
    assert "transformer-engine 1.0" in tiers["megatron"]["why"]
