"""engine/weights_io.py on CUDA: tensors read in pieces through the pinned ring land on the device
byte for byte as safetensors reads them, with pieces smaller than the tensors and a ring that wraps,
and with the 32 MiB default on tensors larger than one piece."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import engine.weights_io as weights_io  # noqa: E402


@pytest.mark.parametrize("piece", [4096, 1 << 20, weights_io.PIECE])
def test_the_pinned_ring_reads_every_byte_onto_the_device(tmp_path, piece):
    g = torch.Generator().manual_seed(1)
    tensors = {"big": torch.randn(3000, 4099, generator=g).to(torch.bfloat16),       # ~24.6 MB
               "odd": torch.randn(333, generator=g), "empty": torch.empty(0, 7),
               "int": torch.arange(10_000, dtype=torch.int64), "scalar": torch.tensor(1.5, dtype=torch.float16),
               "large": torch.randn(9000, 4100, generator=g)}                          # ~147 MB: 5 pieces of 32 MiB
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    saved = weights_io.PIECE
    weights_io.PIECE = piece
    try:
        ours = dict(weights_io.iter_tensors(path, torch.device("cuda")))
    finally:
        weights_io.PIECE = saved
    torch.cuda.synchronize()
    with safe_open(str(path), framework="pt") as f:
        assert sorted(ours) == sorted(f.keys())
        for name in f.keys():
            assert ours[name].is_cuda and torch.equal(ours[name].cpu(), f.get_tensor(name)), name
