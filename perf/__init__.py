"""Performance profiles: how long an engine step takes and what one worker holds, as plain data and
pure functions (perf/profile.py, with the measured and analytic profiles in perf/profiles/), and
the ITL guard priced with them (perf/itl_guard.py), which the frontend and the planner's
simulator both apply.

The router, the planner, the simulators and the mock engine all read the same profile. Nothing here
imports the control plane's I/O (Redis, gRPC) or torch, so every layer may import it.
"""
