"""Virtual-clock simulators behind `splitserve bench plan` and `splitserve bench routesim`.

- workload.py: request traces read into arrays, scaled, or generated.
- plan/: the SLA planner's simulator (the real planner core over simulated pools) and the static
  baseline it is compared with.
- route/: the routing simulator (the real router over simulated workers).
- oracle.py: the pooled-cache oracle that routing results are measured against.

Time is virtual: nothing sleeps, nothing crosses a socket. No grpc, redis, ray, nixl or torch; the
CLI (splitserve/bench/) parses flags, calls in, and prints the records.
"""
