"""The KV tiers in an engine on the GPU (skipped without CUDA): async scheduling, pinned host tier,
each mover (torch side stream, NIXL), bf16 and fp8 KV. A tiny G1 forces offload and onboarding
from host RAM and disk; the tokens equal an unconstrained run's."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from engine.engine import Engine  # noqa: E402
from kvstore.events import Tier  # noqa: E402
from kvstore.movers.transfer import nixl_available  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.types import EngineRequest, SamplingParams  # noqa: E402
from splitserve.models import resolve_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def run(eng, seq, tag):
    out = {}
    for i, p in enumerate(seq):
        eng.add_request(EngineRequest(f"{tag}{i}", p, GREEDY))
        while eng.has_work:
            for o in eng.step().outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if eng.tier_io is not None:
            eng.tiers.drain()
    return [out[f"{tag}{i}"] for i in range(len(seq))]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("mover", ["torch", "nixl"])
def test_offload_and_onboarding_on_the_gpu_keep_tokens_identical(tmp_path, mover, kv_dtype):
    if mover == "nixl" and not nixl_available():
        pytest.skip("nixl not installed")
    model = resolve_model("tiny")
    rng = random.Random(0)
    a, b, f1, f2 = ([rng.randrange(1, 200) for _ in range(52)] for _ in range(4))
    seq = [a, a, b, f1, f2, b, a]
    # the tiny model's 32-wide heads are below what FlashInfer's paged kernels accept (an invalid
    # configuration on the H100): the torch attention backend runs them, the tiers are the same
    base = dict(model=model, device="cuda", kv_cache_dtype=kv_dtype, async_scheduling=True,
                attention_backend="torch")
    want = run(Engine(EngineConfig(**base, num_blocks=256)), seq, "r")
    bb = Engine(EngineConfig(**base, num_blocks=4)).runner.block_bytes
    eng = Engine(EngineConfig(**base, num_blocks=8, kv_host_gib=10 * bb / 2**30, kv_disk_gib=64 * bb / 2**30,
                              kv_disk_dir=str(tmp_path), kv_onboard="always", kv_host_copy=mover))
    try:
        assert eng.tier_io.mover.name == mover
        assert run(eng, seq, "t") == want
        st = eng.stats().tiers
        assert st.loaded_blocks[Tier.HOST] >= 3 and st.loaded_blocks[Tier.DISK] >= 1
    finally:
        eng.close()
