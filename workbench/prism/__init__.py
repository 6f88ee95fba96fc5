"""MoE-Prism (issue 16; seed 001): elastic sub-experts — the offline refactoring (partition
solver, proxy gate) first."""
