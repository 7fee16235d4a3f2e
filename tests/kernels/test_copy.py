import pytest
import torch

from quantkit.kernels.copy import BLOCK, device_copy


@pytest.mark.parametrize("numel, dtype", [(1, torch.uint8), (4099, torch.uint8), (2 * BLOCK + 3, torch.int32),
                                          (BLOCK * 3, torch.bfloat16), (777, torch.float32)])
def test_copy_equals_torch(numel, dtype):
    src = torch.randint(-100, 100, (numel,), dtype=torch.int32).to(dtype)
    dst = torch.full_like(src, 7)
    assert device_copy(dst, src) is dst
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_copy_between_dtypes_of_equal_bytes():
    src = torch.randn(6, 130, dtype=torch.bfloat16)
    dst = torch.zeros(6 * 130 // 2, dtype=torch.int32)
    device_copy(dst, src)
    assert torch.equal(dst.view(torch.bfloat16).view(6, 130), src)


def test_copy_rejects_bad_input():
    with pytest.raises(ValueError, match="same size"):
        device_copy(torch.empty(10, dtype=torch.uint8), torch.empty(11, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        device_copy(torch.empty(10, 10).t(), torch.empty(100))

