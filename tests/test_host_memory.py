"""Freed host memory is reused without page faults once `keep_freed_memory` is on (the CPU trainer turns it on)."""

import json
import subprocess
import sys

CYCLES = """
import json, resource, sys, torch
from infer.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
faults = []
for _ in range(8):  # a training step's pattern: the same large activations allocated, written and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gate_up = torch.ones(4096, 2752)  # 45 MB, above glibc's largest mmap threshold
    act = torch.nn.functional.silu(gate_up[:, :1376]) * gate_up[:, 1376:]
    out = act @ torch.ones(1376, 64)
    del gate_up, act, out
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def page_faults(mode: str) -> dict:
    """Minor page faults per step-like cycle of allocations, in a fresh process (malloc's settings are process-wide)."""
    out = subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_freed_memory_is_reused_without_page_faults():
    """After a few cycles every allocation reuses memory freed before (glibc's memalign may take a fresh block
    for the first few); the control, glibc's defaults, maps the large blocks anew in every cycle."""
    pages = 4096 * 2752 * 4 // 4096  # the largest block's pages
    kept, default = page_faults("keep"), page_faults("default")
    assert kept["applied"]
    assert kept["faults"][0] > pages  # the first cycle maps its blocks
    assert sum(kept["faults"][4:]) < pages // 100
    assert min(default["faults"]) > pages
