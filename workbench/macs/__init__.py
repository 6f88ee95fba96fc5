"""MACS (seed 002): calibration files; the dispatch itself is workbench.sim.macs."""
