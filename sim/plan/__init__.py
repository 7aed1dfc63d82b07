"""The planner simulator behind `splitserve bench plan`: workloads, simulated pools, the event
loop that drives them through the planner core, and the static baseline search."""
