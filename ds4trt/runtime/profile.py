"""Per-phase timing: NVTX ranges for nsys, and p50/p99 latencies for `ds4-run --profile`.

    with PHASES.phase("verify"):
        ...

Phases: prefill, decode, draft, verify, accept, commit. NVTX ranges are emitted when CUDA is available
(scripts/profile_nsys.sh records them); wall times are recorded only while `PHASES.enabled` is set, with a
device synchronization at each boundary so the time belongs to the phase (which costs speed: profile
runs are for looking, not for benchmarks).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self):
        self.enabled = False
        self.times: dict[str, list[float]] = {}

    @contextmanager
    def phase(self, name: str):
        nvtx = torch.cuda.is_available()
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        if self.enabled and nvtx:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                if nvtx:
                    torch.cuda.synchronize()
                self.times.setdefault(name, []).append(time.perf_counter() - t0)
            if nvtx:
                torch.cuda.nvtx.range_pop()

    def report(self) -> str:
        lines = ["phase      calls     p50 ms     p99 ms   total s"]
        for name, ts in self.times.items():
            s = sorted(ts)
            pct = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1e3  # noqa: E731
            lines.append(f"{name:<9} {len(s):6d} {pct(0.5):10.3f} {pct(0.99):10.3f} {sum(s):9.3f}")
        return "\n".join(lines)


PHASES = PhaseTimer()
