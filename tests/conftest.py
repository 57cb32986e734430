"""Shared fixtures: the tiny model config and its GGUF files, written once per session.

    tiny_cfg         ds4trt.testing.tiny_gguf.tiny_config() (6 layers: 2 sliding, ratio 4 + indexer, ratio 8)
    tiny_gguf        Path of the tiny target GGUF (seed 0; IQ2_XXS gate/up, Q2_K down experts)
    tiny_mtp_gguf    Path of its MTP GGUF (seed 1; Q4_K experts, F32 plain tensors)
    write_tiny       write_tiny(name, cfg=None, mtp=False, **kw) -> Path: a variant in this test's tmp_path
                     (kw go to write_model_gguf / write_mtp_gguf: drop, retype, reshape, metadata_overrides, ...)
    kernel_device    where a CUDA C++ kernel of plugins/kernels runs, each test twice: "cpu" (the CPU stand-in of
                     cuda_emu.py: cuda_launch.launch replaced, tensors in host memory) and "cuda" (a GPU)
"""

from __future__ import annotations

import pytest
import torch

from ds4trt.testing.tiny_gguf import tiny_config, write_model_gguf, write_mtp_gguf


@pytest.fixture(scope="session")
def tiny_cfg():
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_cfg):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_model_gguf(path, tiny_cfg)
    return path


@pytest.fixture(scope="session")
def tiny_mtp_gguf(tmp_path_factory, tiny_cfg):
    path = tmp_path_factory.mktemp("tiny") / "tiny-mtp.gguf"
    write_mtp_gguf(path, tiny_cfg)
    return path


@pytest.fixture
def write_tiny(tmp_path, tiny_cfg):
    def write(name: str = "variant.gguf", cfg=None, mtp: bool = False, **kw):
        path = tmp_path / name
        (write_mtp_gguf if mtp else write_model_gguf)(path, cfg or tiny_cfg, **kw)
        return path
    return write


@pytest.fixture(params=["emu", "cuda"])
def kernel_device(request, monkeypatch):
    import cuda_emu
    from ds4trt.plugins.kernels import cuda_launch

    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU (scripts/gpu_kernels.sh on the H200)")
        return "cuda"
    if not cuda_emu.available():
        pytest.skip("the CPU stand-in needs g++")
    monkeypatch.setattr(cuda_launch, "launch", cuda_emu.launch)
    return "cpu"
