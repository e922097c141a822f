"""The GPU itself: torch sees it and can use it (a CPU build of torch beside an NVIDIA GPU fails here, naming the
reinstall; the rest of the tier then skips pointing here)."""

from __future__ import annotations

import pytest
from gpu_world import cuda_state, needs_a_gpu

pytestmark = needs_a_gpu()


@pytest.mark.covers(fix="install a CUDA build of torch in .venv")
def test_cuda_device(record_property):
    import torch

    usable, why, fix = cuda_state()
    assert usable, f"{why}  -> {fix}"
    p = torch.cuda.get_device_properties(0)
    record_property("measured", f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch "
                    f"{torch.__version__} CUDA {torch.version.cuda}, bf16 "
                    f"{'yes' if torch.cuda.is_bf16_supported() else 'NO'}")
