"""The live offloaded runtime: host store, expert cache, transfer engine, clocks, the step loop."""
