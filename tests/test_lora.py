"""LoRA under FSDP2 (parallel/lora.py): train_flux_kontext.py with LORA_RANK > 0 end to end on
the tiny Kontext model, and the adapters' dtypes, frozen base and export in process.

    python -m pytest tests/test_lora.py -q

Runs (module-scoped, fp32 so that 1 process and 2 ranks agree to rounding; ref beside two, then
resumed beside one):
    ref       python, BATCH_SIZE=4, LoRA rank 4 / alpha 8
    two       torchrun 2, BATCH_SIZE=2, the same LoRA, EMA of the adapters, a checkpoint at step 2,
              merged export too
    resumed   torchrun 2 from a copy of two's step-2 checkpoint (must equal two bit for bit)
    one       python, BATCH_SIZE=4, from the same 2-rank checkpoint (resharded to a world of one)
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from tests.conftest import (DmdRuns, assert_kontext_resumed_bit_exact, free_port, kontext_run, launch_all,
                            read_checkpoint, read_metrics, tiny_default)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import fsdp_utils
import train_flux_kontext as tfk
from families import flux
from components.config import script_constants
from core.errors import ConfigError
from components.export import LORA_WEIGHTS, export_lora
from components.warnings import quiet_known_warnings
from parallel import lora

LORA = ["--lora_rank=4", "--lora_alpha=8", "--lr=3e-3"]
TWO = ["--batch_size=2", "--ema_decay=0.5", "--save_every=2", "--sample_every=0", "--lora_export_merged=1"]


@pytest.fixture(scope="module")
def runs(kontext_setup):
    root, out = kontext_setup["root"] / "lora", {}
    os.makedirs(root)
    ref = LORA + ["--batch_size=4", "--sample_every=0"]
    out.update(launch_all({"ref": kontext_run(kontext_setup, root / "ref", ref, ranks=1),
                           "two": kontext_run(kontext_setup, root / "two", LORA + TWO)}))
    for name in ("resumed", "one"):
        os.makedirs(root / name / "checkpoints")
        shutil.copytree(root / "two" / "checkpoints" / "step_000002", root / name / "checkpoints" / "step_000002")
    one = ["--batch_size=4", "--ema_decay=0.5", "--sample_every=0"]
    out.update(launch_all({"resumed": kontext_run(kontext_setup, root / "resumed", LORA + TWO + ["--resume=auto"]),
                           "one": kontext_run(kontext_setup, root / "one", LORA + one + ["--resume=auto"], ranks=1)}))
    return {k: (str(root / k), v.stdout) for k, v in out.items()}


@pytest.mark.slow
def test_two_ranks_match_one_process_losses_and_adapters(runs, kontext_setup):
    ref, two = read_metrics(runs["ref"][0]), read_metrics(runs["two"][0])
    for a, b in zip(ref, two, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5, (a, b)
    a = read_checkpoint(runs["ref"][0], 3)["model.transformer"]
    b = read_checkpoint(runs["two"][0], 3)["model.transformer"]
    assert a.keys() == b.keys() and all(lora.is_adapter(k) for k in a)  # adapters only, no base
    with torch.device("meta"):  # exactly the adapters that add_lora puts on the model
        from diffusers import FluxTransformer2DModel
        meta = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(
            os.path.join(kontext_setup["model_path"], "transformer")))
    lora.add_lora(meta, lora.Lora(rank=4, alpha=8))
    assert {k: tuple(v.shape) for k, v in a.items()} == {n: tuple(p.shape) for n, p in meta.named_parameters()
                                                         if p.requires_grad}
    for k in a:
        assert a[k].dtype == torch.float32
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert any(v.abs().max() > 0 for k, v in a.items() if ".lora_B." in k)  # B starts at 0: it trained


@pytest.mark.slow
def test_resume_is_bit_exact_and_reshards_to_one_process(runs):
    two = assert_kontext_resumed_bit_exact(runs["two"][0], runs["resumed"][0], 3)
    one = read_checkpoint(runs["one"][0], 3)["model.transformer"]  # saved on 2 ranks, resumed on 1
    for k, v in two["model.transformer"].items():
        torch.testing.assert_close(one[k], v, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_checkpoint_holds_only_what_trains(runs):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    path = os.path.join(runs["two"][0], "checkpoints", "step_000003")
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_keys = [k for k in meta if k.startswith("model.transformer.")]
    assert model_keys and all(lora.is_adapter(k) for k in model_keys)
    assert sorted(k.replace("model.ema.", "") for k in meta if k.startswith("model.ema.")) == [
        f"shadow.{i}" for i in sorted(map(str, range(len(model_keys))))]  # the EMA of the adapters only

    def nbytes(keys):
        return sum(meta[k].size.numel() * meta[k].properties.dtype.itemsize for k in keys
                   if isinstance(meta[k], TensorStorageMetadata))
    from safetensors import safe_open
    with safe_open(os.path.join(runs["two"][0], "export_merged", "transformer",
                                "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        base = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    # adapters (fp32) + their EMA + AdamW's two moments: 4 x 4 bytes per adapter param, no base
    adapters = nbytes(model_keys) // 4
    assert nbytes(list(meta)) == 16 * adapters + nbytes([k for k in meta if k.endswith(".step")])
    assert adapters < base / 5


@pytest.mark.slow
def test_export_loads_with_load_lora_weights_and_matches_merged(runs, kontext_setup):
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel
    out = runs["two"][0]
    assert os.listdir(os.path.join(out, "export")) == [LORA_WEIGHTS]
    pipe = FluxKontextPipeline.from_pretrained(kontext_setup["model_path"], dtype=torch.float32)
    pipe.load_lora_weights(os.path.join(out, "export"))
    merged = FluxTransformer2DModel.from_pretrained(os.path.join(out, "export_merged", "transformer"))
    inputs = transformer_inputs(merged.config)
    with torch.no_grad():
        torch.testing.assert_close(pipe.transformer(**inputs).sample, merged(**inputs).sample, rtol=1e-4, atol=1e-5)


def transformer_inputs(cfg):
    """FLUX.1 Kontext's forward inputs as its spec lays them out: a 8 x 8 latent target and context, 8 text
    tokens (the same draws every call; tests/test_lowbit.py's too)."""
    from families.flux.spec import SPEC
    with torch.random.fork_rng():
        torch.manual_seed(0)
        inputs = SPEC.example_inputs(cfg, 1, [(8, 8), (8, 8)], 8, torch.device("cpu"), torch.float32)
    inputs.pop("return_dict")  # the callers read the output's .sample
    inputs["timestep"] = torch.tensor([0.5])  # exact in bf16: a bf16 model's error is its own rounding alone
    return inputs


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed"])
def test_sharded_lora_dtypes_frozen_base_and_export(kontext_setup, tmp_path, mode):
    """LoRA on a world of one: the base stored in the compute dtype with no grads ever, adapters
    and AdamW state in fp32; after a few steps the base is bit-identical to the folder's weights,
    and the exported LoRA file, loaded onto the base pipeline, reproduces the trained model's
    output (fp32: to rounding; bf16-mixed: both compute in bf16 from the same weights)."""
    import torch.distributed as dist
    from diffusers import FluxKontextPipeline
    from precision import get_precision
    from safetensors.torch import load_file
    prec = get_precision(mode)
    folder = os.path.join(kontext_setup["model_path"], "transformer")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        quiet_known_warnings()
        mesh = fsdp_utils.build_meshes(torch.device("cpu"), 1)[0]
        model = flux.build_transformer(folder, mesh, prec, torch.device("cpu"), load=True,
                                      sharding=fsdp_utils.Sharding(), block_classes=[], seed=0,
                                      lora=lora.Lora(rank=4, alpha=8))
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-2)
        inputs = transformer_inputs(model.config)
        for _ in range(3):
            model(**inputs).sample.square().mean().backward()
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
            opt.step()
            opt.zero_grad()
        for name, p in model.named_parameters():
            assert p.dtype == (torch.float32 if lora.is_adapter(name) else prec.compute_dtype), name
            assert p.requires_grad == lora.is_adapter(name), name
        assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if v.dim())
        fsdp_utils.reshard_all(model)
        stored = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
        for name, p in model.named_parameters():
            if not lora.is_adapter(name):
                want = stored[lora.safetensors_key(name)].to(prec.compute_dtype)
                assert torch.equal(p.full_tensor(), want), name
        assert any(p.full_tensor().abs().max() > 0 for n, p in model.named_parameters() if ".lora_B." in n)
        with torch.no_grad():
            trained_out = model(**inputs).sample.float()
        export_lora(model, str(tmp_path / "export"), "FluxKontextPipeline", "transformer", torch.float32)
    finally:
        dist.destroy_process_group()
    pipe = FluxKontextPipeline.from_pretrained(kontext_setup["model_path"], dtype=prec.compute_dtype)
    pipe.load_lora_weights(str(tmp_path / "export"))
    cast = {
        k: v.to(prec.compute_dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()
    }
    with torch.no_grad():
        out = pipe.transformer(**cast).sample.float()
    atol = 1e-5 if mode == "fp32" else 3e-2
    torch.testing.assert_close(out, trained_out, rtol=0, atol=atol)


def test_bad_lora_settings_fail_with_one_line(monkeypatch, capsys):
    saved = script_constants(vars(tfk))
    try:
        for argv, message in ((["--lora_rank=-1"], "LORA_RANK=-1: must be >= 0"),
                              (["--lora_rank=4", "--lora_target_modules=to_qq"],
                               "LORA_TARGET_MODULES: 'to_qq' matches no Linear"),
                              (["--lora_rank=4", "--lora_init=kaiming"], "LORA_INIT='kaiming': choose one of"),
                              (["--lora_rank=4", "--lora_target_modules=blocks,to_q"], "a preset .* stands alone")):
            monkeypatch.setattr(sys, "argv", ["train_flux_kontext.py"] + argv)
            with pytest.raises(ConfigError, match=message) as e:
                tfk.main()
            assert "\n" not in str(e.value)
            vars(tfk).update(saved)
    finally:
        vars(tfk).update(saved)


@pytest.mark.parametrize("init,std", [("default", 3 ** -0.5), ("gaussian", 1.0)])
def test_lora_init_draws_as_peft_does(init, std):
    """LORA_INIT: "default" is peft's default init (kaiming-uniform, a = √5: U(±1/√fan_in), the
    official DMD2 LoRA run's), "gaussian" N(0, 1/rank²); lora_B = 0. Checked against what peft
    itself draws for the same LoraConfig on a materialised UNet with the official DMD2 targets
    (linear and conv layers), in units of the bound (√fan_in) or of 1/rank; same seed, same draw."""
    from families.sd_unet import DMD2_LORA_TARGETS
    from tests.conftest import tiny_unet
    rank = 4
    unet = lora.add_lora(tiny_unet(), lora.Lora(rank=rank, targets=DMD2_LORA_TARGETS, init=init))
    assert unet.peft_config["default"].init_lora_weights == (True if init == "default" else "gaussian")
    peft_drawn = {n: p.detach().clone() for n, p in unet.named_parameters() if ".lora_A." in n}
    lora.init_lora(unet, seed=0)
    ours = {n: p.detach().clone() for n, p in unet.named_parameters() if ".lora_A." in n}
    assert any(".conv1.lora_A." in n for n in ours) and any(".to_q.lora_A." in n for n in ours)

    def unit(t):  # values in units of the init's scale: U(-1, 1) or N(0, 1)
        return t * (t[0].numel() ** 0.5 if init == "default" else rank)
    mine, theirs = (torch.cat([unit(t).flatten() for t in d.values()]) for d in (ours, peft_drawn))
    for values in (mine, theirs):
        assert abs(values.std().item() - std) < 0.05 * std, (init, values.std())
    if init == "default":
        assert mine.abs().max() <= 1 and theirs.abs().max() <= 1
    assert all(p.abs().max() == 0 for n, p in unet.named_parameters() if ".lora_B." in n)
    lora.init_lora(unet, seed=0)
    assert all(torch.equal(p, ours[n]) for n, p in unet.named_parameters() if n in ours)


# ----------------------------------------------------------------------------------------------
# train_dmd.py: LoRA generator and fake score (the official --generator_lora path), GAN, EMA

DMD = ["--max_steps=4", "--log_every=1", "--dfake_gen_update_ratio=2", "--precision=fp32", "--use_gan=1",
       "--ema_decay=0.9", "--sample_every=0", "--seed=3", "--save_every=4", "--lora_rank=4", "--lora_alpha=8",
       "--fake_lora=1", "--generator_lr=1e-3", "--guidance_lr=1e-3", "--warmup_steps=2"]


@pytest.fixture(scope="module")
def dmd_runs(tmp_path_factory):
    dmd = DmdRuns(tmp_path_factory.mktemp("dmd_lora"), DMD + ["--batch_size=1"])
    dmd.launch_all({"two": (["--lora_export_merged=1"],), "one": (["--grad_accum=2"], 1)})
    return dmd.root


@pytest.mark.slow
def test_dmd_lora_two_ranks_match_one_process(dmd_runs):
    ref, two = read_metrics(dmd_runs / "one"), read_metrics(dmd_runs / "two")
    # the published warmup (train_dmd.make_optimizer): both LRs at iteration k = 1e-3·min(1, k/2), the
    # generator's advancing on step 2 too, where it does not update (DFAKE_GEN_UPDATE_RATIO=2)
    for r in two:
        assert r["lr_generator"] == r["lr_guidance"] == pytest.approx(1e-3 * min(1.0, (r["step"] - 1) / 2))
    for a, b in zip(ref, two, strict=True):
        for k in ("loss_dm", "loss_fake", "loss_gen_cls", "loss_guidance_cls"):
            if k in a:
                assert abs(a[k] - b[k]) < 1e-4 * max(1.0, abs(a[k])), (k, a, b)
    a, b = read_checkpoint(dmd_runs / "one", 4, flat=True), read_checkpoint(dmd_runs / "two", 4, flat=True)
    assert a.keys() == b.keys()
    for name in ("generator", "fake"):
        keys = [k for k in a if k.startswith(f".model.{name}.")]
        assert keys and all(lora.is_adapter(k) for k in keys), name  # adapters only: no base
        assert any(a[k].abs().max() > 0 for k in keys if ".lora_B." in k), name  # they trained
    assert any(k.startswith(".model.head.") for k in a)  # the GAN head trains in full
    for k in a:  # the adapters; Adam turns fp noise in ~0 grads into ±lr steps, so lr 1e-3 bounds it
        if k.startswith((".model.generator.", ".model.fake.", ".model.ema.")):
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.slow
def test_dmd_lora_export_loads_onto_the_teacher_pipeline(dmd_runs):
    from diffusers import LCMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    out = dmd_runs / "two"
    teacher, _ = train_dmd_default()
    pipe = StableDiffusionPipeline.from_pretrained(teacher, torch_dtype=torch.float32, safety_checker=None)
    pipe.load_lora_weights(str(out / "export"))
    merged = UNet2DConditionModel.from_pretrained(str(out / "export_merged" / "unet"))
    cfg = merged.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g)
    text = torch.randn(2, 77, cfg.cross_attention_dim, generator=g)
    with torch.no_grad():
        lora_out = pipe.unet(x, 999, text).sample
        torch.testing.assert_close(lora_out, merged(x, 999, text).sample, rtol=1e-4, atol=1e-5)
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)
    image = pipe("a red circle", num_inference_steps=1, guidance_scale=0, timesteps=[999], output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images
    assert torch.isfinite(image).all()


def train_dmd_default():
    import train_dmd
    return train_dmd.default_paths()


def test_the_blocks_preset_is_every_linear_of_the_blocks_but_modulation(kontext_setup):
    """LORA_TARGET_MODULES=blocks on FLUX.1 and Qwen-Image: every Linear inside an FSDP unit (the blocks),
    none of their modulation Linears, nothing outside the blocks, none that nothing reads."""
    import diffusers
    from families import MODELS
    qwen_model, _ = tiny_default("qwen_image_edit")
    for cls, folder in (("FluxTransformer2DModel", os.path.join(kontext_setup["model_path"], "transformer")),
                        ("QwenImageTransformer2DModel", os.path.join(qwen_model, "transformer"))):
        model_cls = getattr(diffusers, cls)
        with torch.device("meta"):
            model = model_cls.from_config(model_cls.load_config(folder))
        names = lora.check_lora_targets(cls, folder, lora.Lora(rank=4, targets=("blocks",)))
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        facts = MODELS[cls]
        in_blocks = {n for n in linears if any(n.startswith(u + ".") for u, m in model.named_modules()
                                               if type(m).__name__ in facts.units)}
        modulation = {n for n in in_blocks if any(part in n + "." for part in facts.modulation)}
        unused = {n for n in in_blocks for u in (facts.unused(model) if facts.unused else [])
                  if n == u or n.startswith(u + ".")}
        assert modulation and set(names) == in_blocks - modulation - unused, cls
        assert len(names) > len(lora.check_lora_targets(cls, folder, lora.Lora(rank=4))), cls
