"""parallel/execution_order.py, parallel/model_facts.py, families/<name>/parallelism.py, families/pipelines.py and
parallel/parallelize.py: a model's FSDP units come in execution order (diffusers' UNets register up_blocks before
mid_block and attentions before resnets), the last-executed unit is the one kept gathered after forward, explicit
prefetch follows that order, and the facts the families give are what the recipe reads.

    python -m pytest tests/test_parallelize.py -q
"""
from __future__ import annotations

import os

import pytest
import torch
from PIL import Image
from torch.distributed.fsdp import FSDPModule

import fsdp_utils
from families import FAMILIES, MODELS
from families.pipelines import PIPELINES, SCRIPTS, folder_layout
from parallel.execution_order import units_in_order
from parallel import model_facts
from parallel.parallelize import parallelize
from precision import get_precision
from tests.conftest import finish, run_ranks, start, tiny_flux, tiny_unet

UNET_UNITS = MODELS["UNet2DConditionModel"].units


def _forward(unet):
    g = torch.Generator().manual_seed(0)
    return unet(torch.randn(1, 4, 8, 8, generator=g), 10, torch.randn(1, 5, 32, generator=g))


# the block forward runs last: the last up block's last attention (SD-1.5 layout: cross-attention up
# blocks last) or its last resnet (SDXL layout: a plain up block last)
LAST = {False: "up_blocks.1.attentions.1.transformer_blocks.0", True: "up_blocks.1.resnets.1"}


def _order_of_forward(model, units):
    seen = []
    hooks = [u.register_forward_pre_hook(lambda m, args: seen.append(m)) for u in units]
    with torch.no_grad():
        _forward(model)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("sdxl", [False, True], ids=["sd15-layout", "sdxl-layout"])
def test_unet_units_come_in_execution_order(sdxl):
    unet = tiny_unet(sdxl=sdxl)
    units = units_in_order(unet, UNET_UNITS)
    assert [id(m) for m in _order_of_forward(unet, units)] == [id(u) for u in units]
    assert units[-1] is unet.get_submodule(LAST[sdxl])
    registered = [m for m in unet.modules() if type(m).__name__ in UNET_UNITS]
    assert {id(m) for m in registered} == {id(u) for u in units}
    assert registered[-1] is unet.mid_block.resnets[-1]  # what "last" was before the order was recorded


def test_flux_units_are_the_double_then_the_single_blocks():
    model = tiny_flux(num_layers=2, num_single_layers=2)
    facts = MODELS["FluxTransformer2DModel"]
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    assert units_in_order(model, facts.units) == blocks
    assert parallelize(model, None, get_precision("fp32").mp_policy(), facts=facts) == blocks


def test_flux2_units_are_the_double_then_the_single_blocks():
    from diffusers import Flux2Transformer2DModel
    model = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                    timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4))
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    assert parallelize(model, None, get_precision("fp32").mp_policy(),
                       facts=MODELS["Flux2Transformer2DModel"]) == blocks


def test_the_families_give_the_facts_parallel_reads():
    """families.MODELS: each spec's model classes, each in one family, the very registry parallel/ reads for a
    caller that passes none; a model class without facts gets the detected units."""
    from families import SPECS
    assert MODELS is model_facts.MODELS and len(MODELS) == sum(len(s.models) for s in SPECS)
    assert all(MODELS[cls] is facts for s in SPECS for cls, facts in s.models.items())
    model = tiny_flux(num_layers=1, num_single_layers=1)
    assert model_facts.facts_of(model) is MODELS["FluxTransformer2DModel"]
    assert model_facts.facts_of(torch.nn.Linear(2, 2)) is None


def test_qwen_image_units_are_its_dual_stream_blocks():
    """QwenImageTransformer2DModel (tiny: 2 blocks, 32 wide): a unit per QwenImageTransformerBlock (its
    _no_split_modules), in order; the generic path would pick the same, the recipe names them; LoRA's
    defaults are diffusers' Qwen-Image example's, each naming layers of the model."""
    from diffusers import QwenImageTransformer2DModel
    from parallel import lora
    model = QwenImageTransformer2DModel(num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                        joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
    facts = MODELS["QwenImageTransformer2DModel"]
    assert list(facts.units) == model._no_split_modules and facts.attention_dispatcher
    assert units_in_order(model, facts.units) == list(model.transformer_blocks)
    for given in (facts, None):  # passed, or looked up by its class
        assert parallelize(model, None, get_precision("fp32").mp_policy(), verbose=False,
                           facts=given) == list(model.transformer_blocks)
    names = {n for n, _ in model.named_modules()}
    for target in lora.lora_targets(model, lora.Lora(4), facts):
        assert any(n.endswith("." + target) for n in names), target


def test_the_table_names_each_scripts_pipelines():
    assert SCRIPTS == {"train_dmd.py": ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxKontextPipeline",
                                        "FluxPipeline", "QwenImageEditPlusPipeline", "Flux2KleinPipeline",
                                        "Flux2Pipeline", "WanPipeline", "WanImageToVideoPipeline", "ZImagePipeline",
                                        "ZImageOmniPipeline"),
                       "train_flux_kontext.py": ("FluxKontextPipeline", "QwenImageEditPlusPipeline",
                                                 "Flux2KleinPipeline", "Flux2Pipeline", "ZImagePipeline",
                                                 "ZImageOmniPipeline")}
    assert set(SCRIPTS["train_dmd.py"]) | set(SCRIPTS["train_flux_kontext.py"]) == set(FAMILIES)  # every room trains
    assert folder_layout("StableDiffusionXLPipeline")["text_encoder_2"] == "CLIPTextModelWithProjection"
    for pipeline, components in PIPELINES.items():
        trained = [c for c in components if c.role == "trainable"]
        assert trained and all(c.class_name in MODELS for c in trained), pipeline


def test_without_a_mesh_the_recipe_only_checkpoints_and_compiles():
    unet = tiny_unet()
    plain = _forward(unet).sample
    units = parallelize(unet, None, get_precision("fp32").mp_policy(),
                        fsdp_utils.Sharding(activation_checkpointing=True), verbose=False,
                        facts=MODELS["UNet2DConditionModel"])
    assert not any(isinstance(m, FSDPModule) for m in unet.modules())
    assert all("forward" in vars(u) for u in units)  # the checkpoint wrapper, patched on the instance
    torch.testing.assert_close(_forward(unet).sample, plain, rtol=0, atol=0)


def _gathered_after_forward(rank, world):
    unet = tiny_unet()
    mesh = fsdp_utils.build_meshes(torch.device("cpu"))[0]
    in_order = units_in_order(unet, UNET_UNITS)
    units = parallelize(unet, mesh, get_precision("fp32").mp_policy(), fsdp_utils.Sharding(prefetch=1), verbose=False,
                        facts=MODELS["UNet2DConditionModel"])
    assert units == in_order
    for i, u in enumerate(units):  # explicit prefetch: the next unit in execution order, and the one before
        state = u._get_fsdp_state()
        assert state._states_to_forward_prefetch == [v._get_fsdp_state() for v in units[i + 1:i + 2]]
        assert state._states_to_backward_prefetch == [v._get_fsdp_state() for v in units[max(0, i - 1):i]]
    with torch.no_grad():
        _forward(unet)
    names = {id(m): n for n, m in unet.named_modules()}
    gathered = [names[id(m)] for m in unet.modules() if isinstance(m, FSDPModule)
                and m._get_fsdp_state()._fsdp_param_group.is_unsharded]
    assert gathered == ["", LAST[False]], gathered  # the root and the last-executed unit


@pytest.mark.slow
def test_last_executed_unit_stays_gathered_and_prefetch_follows_execution():
    run_ranks(_gathered_after_forward, 2)


@pytest.mark.slow
def test_prefetch_leaves_dmd_samples_unchanged(tmp_path):
    """With units in registration order, PREFETCH=1 changed the last sample grid of this run (max
    pixel difference 4/255 in fp32, 71/255 in bf16-mixed, against PREFETCH=0); in execution order
    the grids are identical."""
    args = ["--max_steps=6", "--precision=fp32", "--ema_decay=0.9", "--sample_every=3", "--save_every=0",
            "--log_every=3", "--dfake_gen_update_ratio=2"]
    procs = [start("train_dmd.py", args + [f"--prefetch={p}", f"--output_dir={tmp_path / str(p)}"]) for p in (0, 1)]
    for proc in procs:  # both at once: their startup overlaps
        rc, log = finish(proc)
        assert rc == 0, log[-3000:]
    for step in (3, 6):
        grids = [
            Image.open(os.path.join(tmp_path, str(p), "samples", f"step_{step:06d}.png")).tobytes() for p in (0, 1)
        ]
        assert grids[0] == grids[1], step
