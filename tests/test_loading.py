"""parallel/loading.py: a model built on the meta device, sharded by its recipe, then each rank
loading only its slices of a diffusers folder's safetensors (single file or sharded with an index)
equals the model diffusers loads; a wrong folder fails in one line.

    python -m pytest tests/test_loading.py -q
"""
from __future__ import annotations

import pytest
import torch

import fsdp_utils
from core.errors import ConfigError
from parallel import loading
from parallel.parallelize import parallelize
from tests.conftest import run_ranks, tiny_unet


def _meta_load(rank, world, folder, dtype_name):
    from diffusers import UNet2DConditionModel
    from precision import get_precision, parse_dtype
    ref = UNet2DConditionModel.from_pretrained(folder).state_dict()
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    model = loading.build_on_meta(UNet2DConditionModel, folder).to(parse_dtype(dtype_name))
    parallelize(
        model,
        mesh,
        get_precision("fp32").mp_policy(),
        block_classes=["BasicTransformerBlock", "ResnetBlock2D"],
        verbose=False,
    )
    loading.materialize_and_load(model, folder, torch.device("cpu"))
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert full.dtype == parse_dtype(dtype_name)
        torch.testing.assert_close(full, ref[k].to(full.dtype), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("sharded_files", [False, True], ids=["single-file", "sharded-index"])
def test_meta_device_load_equals_original(tmp_path, sharded_files):
    unet = tiny_unet()
    unet.save_pretrained(tmp_path / "unet", max_shard_size="200KB" if sharded_files else "10GB")
    if sharded_files:
        assert (tmp_path / "unet" / "diffusion_pytorch_model.safetensors.index.json").exists()
    run_ranks(_meta_load, 2, str(tmp_path / "unet"), "bf16" if sharded_files else "fp32")


def test_meta_load_rejects_wrong_folder(tmp_path):
    from diffusers import UNet2DConditionModel
    with pytest.raises(ConfigError, match="no config.json"):
        loading.build_on_meta(UNet2DConditionModel, str(tmp_path))


def test_weights_of_another_model_fail_naming_a_tensor(tmp_path):
    from diffusers import UNet2DConditionModel
    tiny_unet().save_pretrained(tmp_path / "a")
    other = tiny_unet(sdxl=True)
    other.save_pretrained(tmp_path / "b")
    model = loading.build_on_meta(UNet2DConditionModel, str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="weights have no tensor|has shape"):
        loading.materialize_and_load(model, str(tmp_path / "a"), torch.device("cpu"))


def test_one_safetensors_file_loads_like_its_folder(tmp_path):
    """A bare state dict (.safetensors, e.g. DMD2's GENERATOR_INIT) loads into a skeleton built from
    another folder's config: every tensor equal, cast to the model's dtype."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import save_file
    tiny_unet(seed=0).save_pretrained(tmp_path / "config_from")
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in tiny_unet(seed=1).state_dict().items()}
    save_file(weights, str(tmp_path / "g.safetensors"))
    model = loading.build_on_meta(UNet2DConditionModel, str(tmp_path / "config_from"))
    loading.materialize_and_load(model, str(tmp_path / "g.safetensors"), torch.device("cpu"))
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, weights[k].float()), k


def test_check_same_tensors_names_the_first_difference(tmp_path):
    from safetensors.torch import save_file
    tiny_unet().save_pretrained(tmp_path / "ref")
    state = {k: v.contiguous() for k, v in tiny_unet(seed=1).state_dict().items()}
    save_file(state, str(tmp_path / "same.safetensors"))
    loading.check_same_tensors(str(tmp_path / "same.safetensors"), str(tmp_path / "ref"), "X")  # passes
    tiny_unet(sdxl=True).save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"X=.*other: not the model of .*ref: \d+ tensors missing"):
        loading.check_same_tensors(str(tmp_path / "other"), str(tmp_path / "ref"), "X")
    key = "conv_in.weight"
    save_file({**state, key: torch.zeros(8, 4, 3, 3)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ConfigError, match=r"conv_in.weight has shape \[8, 4, 3, 3\], the model of .* \[32, 4, 3, 3\]"):
        loading.check_same_tensors(str(tmp_path / "shape.safetensors"), str(tmp_path / "ref"), "X")
