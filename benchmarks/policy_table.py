"""Print the policies table of docs/policies.md: what each policy keeps on a GPT block.

Run with ``python benchmarks/policy_table.py`` and paste the output into the docs.
"""

from __future__ import annotations

import collections
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from gpt_policies import Block

from remat import residual_totals, saved_residuals

POLICIES = (
    "nothing-saveable",
    "dots-no-batch-saveable",
    "dots-saveable",
    "save:attn_out",
    "everything-except:attn_out",
    "save:attn_out+dots-no-batch-saveable",
    "offload-dots",
    "save-last",
    "everything-saveable",
)


def main() -> None:
    torch.manual_seed(0)
    block, x = Block(64, 4), torch.randn(2, 16, 64)
    print("| policy | kept (bytes) | what it keeps |\n|---|---:|---|")
    for policy in POLICIES:
        held = saved_residuals(block, x, policy=policy)
        totals = residual_totals(held)
        kept = [r for r in held if r.decision != "input" and not r.shared]
        counts = collections.Counter(
            f"`{r.name}`" if r.name else f"`{r.op.overloadpacket.__name__}`" for r in kept
        )
        what = ", ".join(f"{k} \u00d7{v}" if v > 1 else k for k, v in counts.items())
        what = (what or "inputs and parameters only") + (
            " (offloaded)" if totals["offloaded"] else ""
        )
        print(f"| `{policy}` | {totals['saved'] + totals['offloaded']:,} | {what} |")


if __name__ == "__main__":
    main()
