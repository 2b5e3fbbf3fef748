"""`shmkv check` on a GPU host judges the CUDA part against each GPU and the
driver (shown here on stand-ins for torch and _C_cuda: no GPU needed): a GPU
whose architecture the build carries as machine code passes, one covered by
PTX only passes saying the driver compiles it, one it carries neither
machine code nor older PTX for fails naming the build flag; a driver older than the runtime the
part was built for fails naming the update."""

from __future__ import annotations

import types

import pytest

from shmkv.check import FAIL, OK, _check_gpu_build

ARCHS = "80-real 86-real 89-real 90-real 100-real 120-real 120-virtual"


def torch_with(major: int, minor: int):
    cuda = types.SimpleNamespace(get_device_name=lambda i: "Some GPU",
                                 get_device_capability=lambda i: (major, minor))
    return types.SimpleNamespace(cuda=cuda)


def part(archs: str = ARCHS, built: int = 13000):
    return types.SimpleNamespace(ARCHITECTURES=archs, CUDA_RUNTIME_BUILT=built)


@pytest.mark.parametrize("cap,status,words", [
    ((9, 0), OK, "machine code"),
    ((12, 1), OK, "PTX, compiled by the driver"),
    ((7, 5), FAIL, "-DCMAKE_CUDA_ARCHITECTURES=75-real"),
])
def test_the_build_against_the_gpu(cap, status, words):
    f = _check_gpu_build(torch_with(*cap), part(), 0, 13000)
    assert f.status == status and (words in f.detail or words in f.fix), f


def test_a_driver_older_than_the_runtime_fails_naming_the_update():
    f = _check_gpu_build(torch_with(9, 0), part(), 0, 12080)
    assert f.status == FAIL and "supports CUDA 12.8" in f.detail and "built for 13.0" in f.detail
    assert "update the NVIDIA driver" in f.fix
