"""The scheduler's parts (engine/scheduler.py composes them; each is plain Python, no torch):

- `order.PrefillOrder`: the waiting queue's order (arrival, or a prefill worker's deadline order);
- `remote.RemotePrefills`: a decode worker's requests whose KV a prefill worker computes, and a
  prefill worker's finished requests whose blocks stay pinned until the decode side has the KV;
- `onboarding.OnboardingManager` (KV tiers only): offload of G1 blocks ahead of their eviction,
  and onboarding of a prompt's prefix hit below G1.

None of them schedules a step: the `Scheduler` keeps the step, admission, preemption and stops.
"""
