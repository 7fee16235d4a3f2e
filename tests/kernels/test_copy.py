import pytest
import torch

from quantkit.kernels.copy import BLOCK, device_copy, device_read, read_sums_reference


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



@pytest.mark.parametrize("numel", [1, BLOCK - 1, 2 * BLOCK + 5])
def test_read_sums_equal_the_twin_and_wrap(numel):
    gen = torch.Generator().manual_seed(numel)
    src = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, generator=gen)  # sums overflow int32
    sums = device_read(src)
    assert sums.dtype == torch.int32 and sums.numel() == -(-numel // BLOCK)
    assert torch.equal(sums, read_sums_reference(src))
    assert torch.equal(device_read(src.view(torch.uint8)), sums)  # any dtype: its bytes as words


def test_read_into_given_sums_and_rejects_bad_input():
    src = torch.randint(0, 255, (3, BLOCK + 8), dtype=torch.uint8)
    sums = torch.full((1,), 5, dtype=torch.int32)
    assert device_read(src, sums) is sums
    assert torch.equal(sums, read_sums_reference(src))
    with pytest.raises(ValueError, match="int32 words"):
        device_read(torch.empty(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        device_read(torch.empty(8, 8).t())
    with pytest.raises(ValueError, match="must be 1 int32"):
        device_read(src, torch.empty(2, dtype=torch.int32))
