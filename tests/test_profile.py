"""`ds4-run --profile`: per-phase latency table on stderr, phases recorded where they happen."""

from __future__ import annotations

import pytest
import torch

from ds4trt.cli import run_main
from ds4trt.runtime.profile import PHASES, PhaseTimer

torch.set_num_threads(1)


def test_phase_timer_percentiles():
    t = PhaseTimer()
    t.enabled = True
    t.times["verify"] = [i / 1000 for i in range(1, 101)]        # 1..100 ms
    row = [line for line in t.report().splitlines() if line.startswith("verify")][0].split()
    assert row[1:4] == ["100", "51.000", "100.000"]               # calls, p50, p99 (nearest rank)


def test_disabled_timer_records_nothing():
    t = PhaseTimer()
    with t.phase("decode"):
        pass
    assert t.times == {}


def test_profile_flag_prints_phases(tiny_gguf, tiny_mtp_gguf, capsys):
    try:
        with pytest.raises(SystemExit) as e:
            run_main(["--gguf", str(tiny_gguf), "--mtp", str(tiny_mtp_gguf), "--glm-mtp", "--mtp-margin", "0",
                      "--mtp-draft", "2", "-p", "hello", "-n", "6", "--profile"])
        assert e.value.code == 0
        err = capsys.readouterr().err
        phases = {line.split()[0]: int(line.split()[1]) for line in err.splitlines()
                  if line.split() and line.split()[0] in ("prefill", "draft", "verify", "accept", "commit")}
        assert set(phases) == {"prefill", "draft", "verify", "accept", "commit"}
        assert phases["verify"] == phases["accept"] == phases["commit"] >= 1
    finally:
        PHASES.enabled = False
        PHASES.times.clear()
