"""algorithms/flux_kontext.py (the FLUX.1 Kontext training-step math), fast, on CPU.

Reference behaviour is taken from diffusers' own FluxKontextPipeline helpers and from
running the pipeline itself on tiny random components (no weights, no network).

    python -m pytest tests/test_flux_kontext.py -q
"""

import os
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


from algorithms import flux_kontext as km

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline
from tests.conftest import tiny_flux
from tests.numerics import gamma, unit_roundoff, threads_as_started  # noqa: F401 (autouse)

LATENT_C = 4


def tiny_transformer(seed=0):
    return tiny_flux(seed, in_channels=4 * LATENT_C, guidance_embeds=True).eval()


def tiny_vae(shift=0.1159, scale=0.3611, seed=0):
    torch.manual_seed(seed)
    return AutoencoderKL(
        block_out_channels=(4,),
        latent_channels=LATENT_C,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift,
        scaling_factor=scale,
    ).eval()


def text_inputs(batch, seq=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, 32, generator=g), torch.randn(batch, 32, generator=g)


# ---------------------------------------------------------------- packing / ids


@pytest.mark.parametrize("shape", [(2, 4, 8, 6), (1, 16, 4, 10), (3, 1, 2, 2)])
def test_pack_matches_pipeline_and_roundtrips(shape):
    x = torch.randn(*shape)
    b, c, h, w = shape
    packed = km.pack_latents(x)
    ref = FluxKontextPipeline._pack_latents(x, b, c, h, w)
    assert packed.shape == (b, h // 2 * w // 2, 4 * c)
    assert torch.equal(packed, ref)
    assert torch.equal(km.unpack_latents(packed, h, w), x)
    # diffusers' unpack works in pixel units; with vae_scale_factor 8 this is h*8, w*8
    assert torch.equal(FluxKontextPipeline._unpack_latents(packed, h * 8, w * 8, 8), km.unpack_latents(packed, h, w))


def test_pack_rejects_odd_sizes():
    with pytest.raises(ValueError):
        km.pack_latents(torch.randn(1, 4, 5, 6))
    with pytest.raises(ValueError):
        km.latent_image_ids(6, 3, 0)


@pytest.mark.parametrize("h,w", [(8, 6), (4, 10), (2, 2)])
def test_latent_image_ids_match_pipeline(h, w):
    ref_target = FluxKontextPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    ids0 = km.latent_image_ids(h, w, 0)
    assert ids0.shape == (h // 2 * w // 2, 3)
    assert torch.equal(ids0, ref_target)
    ref_ctx = ref_target.clone()
    ref_ctx[..., 0] = 1  # what FluxKontextPipeline.prepare_latents does for the image ids
    assert torch.equal(km.latent_image_ids(h, w, 1), ref_ctx)
    # row-major: token k sits at (k // (w/2), k % (w/2))
    k = torch.arange(h // 2 * w // 2)
    assert torch.equal(ids0[:, 1], (k // (w // 2)).float())
    assert torch.equal(ids0[:, 2], (k % (w // 2)).float())


def test_prepare_latents_context_ids_and_packing():
    """Call the pipeline's own prepare_latents (with a stub self) on pre-encoded latents."""
    stub = types.SimpleNamespace(
        vae_scale_factor=8,
        latent_channels=LATENT_C,
        _pack_latents=FluxKontextPipeline._pack_latents,
        _prepare_latent_image_ids=FluxKontextPipeline._prepare_latent_image_ids,
    )
    ctx = torch.randn(2, LATENT_C, 4, 10)
    noise = torch.randn(2, LATENT_C, 8, 6)
    latents, image_latents, latent_ids, image_ids = FluxKontextPipeline.prepare_latents(
        stub, ctx, 2, LATENT_C, 8 * 8, 6 * 8, torch.float32, torch.device("cpu"), None, km.pack_latents(noise)
    )
    inputs = km.build_model_inputs(torch.zeros_like(noise), ctx, noise, torch.ones(2))
    assert torch.equal(inputs["hidden_states"], torch.cat([latents, image_latents], dim=1))
    assert torch.equal(inputs["img_ids"], torch.cat([latent_ids, image_ids], dim=0))


def test_encode_latents_matches_pipeline():
    vae = tiny_vae()
    images = torch.rand(2, 3, 8, 8) * 2 - 1
    stub = types.SimpleNamespace(vae=vae)
    with torch.no_grad():
        ref = FluxKontextPipeline._encode_vae_image(stub, images, generator=None)
    lat = km.encode_latents(vae, images)
    assert lat.dtype == torch.float32 and not lat.requires_grad
    assert lat.shape == (2, LATENT_C, 8, 8)
    torch.testing.assert_close(lat, ref)

    vae_none = tiny_vae(shift=None, scale=0.5)
    with torch.no_grad():
        mode = vae_none.encode(images).latent_dist.mode()
    torch.testing.assert_close(km.encode_latents(vae_none, images), mode * 0.5)


def test_encode_latents_bf16_vae_returns_fp32():
    vae = tiny_vae().to(torch.bfloat16)
    lat = km.encode_latents(vae, torch.rand(1, 3, 8, 8) * 2 - 1)
    assert lat.dtype == torch.float32 and torch.isfinite(lat).all()


# ---------------------------------------------------------------- model inputs / loss


def test_build_model_inputs_order_values_ids():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, LATENT_C, 8, 6, generator=g)
    ctx = torch.randn(2, LATENT_C, 4, 10, generator=g)
    n = torch.randn(2, LATENT_C, 8, 6, generator=g)
    s = torch.tensor([0.25, 0.9])
    out = km.build_model_inputs(x0, ctx, n, s)
    nt, nc = 4 * 3, 2 * 5
    assert out["n_target_tokens"] == nt
    assert out["hidden_states"].shape == (2, nt + nc, 4 * LATENT_C)
    assert out["hidden_states"].dtype == torch.float32
    z = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * n
    torch.testing.assert_close(out["hidden_states"][:, :nt], km.pack_latents(z))
    assert torch.equal(out["hidden_states"][:, nt:], km.pack_latents(ctx))
    torch.testing.assert_close(out["target"], km.pack_latents(n - x0))
    ids = out["img_ids"]
    assert ids.shape == (nt + nc, 3)
    assert torch.equal(ids[:nt], km.latent_image_ids(8, 6, 0))
    assert torch.equal(ids[nt:], km.latent_image_ids(4, 10, 1))
    assert (ids[:nt, 0] == 0).all() and (ids[nt:, 0] == 1).all()


def test_token_sequence_is_fine_tunings_and_target_alone_without_context():
    """The one builder of [target ; context] and its ids: what build_model_inputs hands the model, and
    (text-to-image, no context) the target tokens themselves with their (0, r, c) ids."""
    g = torch.Generator().manual_seed(0)
    x0, n = torch.randn(2, LATENT_C, 8, 6, generator=g), torch.randn(2, LATENT_C, 8, 6, generator=g)
    ctx = torch.randn(2, LATENT_C, 4, 10, generator=g)
    s = torch.tensor([0.25, 0.9])
    out = km.build_model_inputs(x0, ctx, n, s)
    target = out["hidden_states"][:, :out["n_target_tokens"]]
    hidden, ids = km.token_sequence(target, (8, 6), km.pack_latents(ctx), (4, 10))
    assert torch.equal(hidden, out["hidden_states"]) and torch.equal(ids, out["img_ids"])
    alone, alone_ids = km.token_sequence(target, (8, 6))
    assert alone is target and torch.equal(alone_ids, km.latent_image_ids(8, 6, 0))


def test_flow_matching_loss_ignores_context_and_matches_hand():
    g = torch.Generator().manual_seed(3)
    nt, nc, d = 6, 4, 8
    pred = torch.randn(2, nt + nc, d, generator=g)
    target = torch.randn(2, nt, d, generator=g)
    w = torch.tensor([0.5, 2.0])
    loss = km.flow_matching_loss(pred, target, nt, w)
    assert loss.dtype == torch.float32 and loss.ndim == 0

    sq = (pred[:, :nt].double() - target.double()) ** 2
    hand = sum(w[b].item() * sq[b].mean().item() for b in range(2)) / 2  # float64
    # fp32: the difference and the square round by 3u·d² per element, each sample's sum of nt·d
    # positive terms by gamma(nt·d) in any order, the divisions, the weights and the batch mean by
    # 4u more; all terms are positive, so the bound is relative to the loss; 2x for second-order terms
    assert abs(loss.item() - hand) <= 2 * (7 * unit_roundoff() + gamma(nt * d)) * hand, (loss.item(), hand)

    pred2 = pred.clone()
    pred2[:, nt:] += 100.0
    assert km.flow_matching_loss(pred2, target, nt, w).item() == loss.item()
    pred3 = pred.clone()
    pred3[:, 0] += 1.0
    assert km.flow_matching_loss(pred3, target, nt, w).item() != loss.item()

    # no gradient reaches the context tokens; bf16 pred still gives an fp32 loss
    p = pred.clone().bfloat16().requires_grad_(True)
    out = km.flow_matching_loss(p, target, nt, None)
    out.backward()
    assert out.dtype == torch.float32
    assert (p.grad[:, nt:] == 0).all() and (p.grad[:, :nt] != 0).any()
    # weights=None equals all-ones
    torch.testing.assert_close(
        km.flow_matching_loss(pred, target, nt, None), km.flow_matching_loss(pred, target, nt, torch.ones(2))
    )


# ---------------------------------------------------------------- sigmas / weights


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "mode"])
def test_sample_sigmas_ranges(scheme):
    g = torch.Generator().manual_seed(0)
    s = km.sample_sigmas(4096, scheme, g)
    assert s.shape == (4096,) and s.dtype == torch.float32
    assert (s > 0).all() and (s <= 1).all()
    assert abs(s.mean().item() - 0.5) < 0.03  # all three densities are symmetric around 0.5 by default
    again = km.sample_sigmas(4096, scheme, torch.Generator().manual_seed(0))
    assert torch.equal(s, again)


def test_sample_sigmas_match_diffusers_density_and_shift():
    from diffusers.training_utils import compute_density_for_timestep_sampling

    for scheme in ["logit_normal", "mode"]:
        ref = compute_density_for_timestep_sampling(
            scheme, 64, logit_mean=0.3, logit_std=1.2, mode_scale=1.29, generator=torch.Generator().manual_seed(5)
        )
        ours = km.sample_sigmas(64, scheme, torch.Generator().manual_seed(5), logit_mean=0.3, logit_std=1.2)
        torch.testing.assert_close(ours, ref.float().clamp(1e-3, 1.0))

    base = km.sample_sigmas(256, "logit_normal", torch.Generator().manual_seed(1))
    shifted = km.sample_sigmas(256, "logit_normal", torch.Generator().manual_seed(1), shift=3.0)
    torch.testing.assert_close(shifted, 3.0 * base / (1 + 2.0 * base))
    assert (shifted >= base).all() and (shifted <= 1).all()
    with pytest.raises(ValueError):
        km.sample_sigmas(2, "bogus", None)


@pytest.mark.parametrize("family", ["kontext_base", "qwen_edit_base"])
def test_auto_shift_is_the_pipelines_own_at_each_size(family):
    """SHIFT=auto: σ shifted as the family's pipeline shifts its σ list for a target of that many tokens (its
    own calculate_shift of the scheduler config, then the scheduler's time_shift), at several sizes; the
    terminal stretch (Qwen-Image: shift_terminal 0.02) is left out, as a sampling device."""
    import numpy as np
    from diffusers.pipelines.flux import pipeline_flux_kontext
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = FlowMatchEulerDiscreteScheduler.load_config(os.path.join(root, "assets", family), subfolder="scheduler")
    pipe = pipeline_flux_kontext if family == "kontext_base" else pipeline_qwenimage_edit_plus
    scheduler = FlowMatchEulerDiscreteScheduler.from_config({**config, "shift_terminal": None})
    grid = np.linspace(1.0, 1 / 28, 28)
    for tokens in (4, 1024, 4096, 8192):
        mu = pipe.calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                                  config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=grid, mu=mu)
        ours = km.shift_sigmas(torch.tensor(grid, dtype=torch.float32), km.sigma_shift("auto", config, tokens))
        # both shift fp32 σ by a few roundings (e^mu once in float64 here, in float32 there): gamma(8) relative
        torch.testing.assert_close(ours, scheduler.sigmas[:-1], rtol=gamma(8), atol=0)
    assert km.sigma_shift("3", config, 4096) == 3.0 and km.shift_sigmas(torch.ones(2), 1.0).equal(torch.ones(2))
    assert km.valid_shift("auto") and km.valid_shift("2.5") and not km.valid_shift("0") and not km.valid_shift("x")


def test_loss_weighting():
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    s = torch.tensor([0.1, 0.5, 0.9, 1.0])
    assert torch.equal(km.loss_weighting(s), torch.ones(4))
    assert torch.equal(km.loss_weighting(s, "none"), torch.ones(4))
    for scheme in ["sigma_sqrt", "cosmap"]:
        torch.testing.assert_close(km.loss_weighting(s, scheme), compute_loss_weighting_for_sd3(scheme, s).float())
    torch.testing.assert_close(km.loss_weighting(s, "sigma_sqrt"), 1 / s**2)
    with pytest.raises(ValueError):
        km.loss_weighting(s, "bogus")


# ---------------------------------------------------------------- transformer


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, LATENT_C, 8, 6, generator=g)
    ctx = torch.randn(2, LATENT_C, 4, 10, generator=g)
    n = torch.randn(2, LATENT_C, 8, 6, generator=g)
    return x0, ctx, n


def test_transformer_forward_shape_finite_backward():
    model = tiny_transformer().train()
    x0, ctx, n = _batch()
    sig = km.sample_sigmas(2, "logit_normal", torch.Generator().manual_seed(0))
    inputs = km.build_model_inputs(x0, ctx, n, sig)
    pe, pooled = text_inputs(2)
    pred = km.transformer_forward(model, inputs, sig, 1.0, pe, pooled)
    assert pred.shape == inputs["hidden_states"].shape
    assert torch.isfinite(pred).all()
    loss = km.flow_matching_loss(pred, inputs["target"], inputs["n_target_tokens"], km.loss_weighting(sig, "cosmap"))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    assert model.time_text_embed.guidance_embedder.linear_1.weight.grad.abs().sum() > 0


def kontext_pipeline(model):
    """FluxKontextPipeline around `model` and the tiny VAE (latent factor 1), without text encoders."""
    sched = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxKontextPipeline(
        scheduler=sched, vae=tiny_vae(), text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=model,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def capture_calls(model) -> tuple[list, object]:
    """(the kwargs of each of `model`'s forwards, cloned; the hook's handle)."""
    calls = []

    def hook(mod, args, kwargs):
        calls.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()})

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_transformer_forward_matches_pipeline_call():
    """Run FluxKontextPipeline itself and capture the transformer kwargs it uses."""
    model = tiny_transformer()
    pipe = kontext_pipeline(model)
    x0, ctx, n = _batch(1)
    pe, pooled = text_inputs(2)
    calls, handle = capture_calls(model)
    try:
        with torch.no_grad():
            pipe(
                image=ctx, prompt_embeds=pe, pooled_prompt_embeds=pooled, height=8, width=6,
                max_area=48, latents=km.pack_latents(n), num_inference_steps=2, guidance_scale=2.5,
                output_type="latent",
            )
    finally:
        handle.remove()
    assert len(calls) == 2
    first = calls[0]
    # step 0 is at sigma = 1: the input is pure noise, i.e. our build with sigma 1
    inputs = km.build_model_inputs(x0, ctx, n, torch.ones(2))
    torch.testing.assert_close(first["hidden_states"], inputs["hidden_states"])
    assert torch.equal(first["img_ids"], inputs["img_ids"])
    assert torch.equal(first["txt_ids"], torch.zeros(pe.shape[1], 3))
    # timestep passed == scheduler sigma (t / 1000); guidance passed raw, shape (B,)
    for i, c in enumerate(calls):
        torch.testing.assert_close(c["timestep"], pipe.scheduler.sigmas[i].expand(2).float())
        assert c["guidance"].shape == (2,) and torch.equal(c["guidance"], torch.full((2,), 2.5))
    # our forward with the same arguments reproduces the pipeline's transformer output
    with torch.no_grad():
        ref = model(**calls[1])[0]
        ours = km.transformer_forward(
            model, {"hidden_states": calls[1]["hidden_states"], "img_ids": calls[1]["img_ids"]},
            calls[1]["timestep"], 2.5, pe, pooled,
        )
    torch.testing.assert_close(ours, ref)


def test_dmd_velocity_is_the_pipelines_at_a_non_square_size():
    """DMD2's conditioning (algorithms/dmd2_flow.FluxCond: the context at the target's size) hands the
    transformer what FluxKontextPipeline does, [noisy target ; context] tokens and their ids, and returns the
    pipeline's prediction on the target's tokens, at an 8 x 6 (h x w) latent: not square, so the ids are told
    from their transposes'."""
    from algorithms import dmd2_flow as fd
    model = tiny_transformer()
    pipe = kontext_pipeline(model)
    _, _, n = _batch(2)
    ctx = torch.randn(2, LATENT_C, 8, 6, generator=torch.Generator().manual_seed(3))
    pe, pooled = text_inputs(2)
    calls, handle = capture_calls(model)
    try:
        with torch.no_grad():
            pipe(image=ctx, prompt_embeds=pe, pooled_prompt_embeds=pooled, height=8, width=6, max_area=48,
                 latents=km.pack_latents(n), num_inference_steps=1, guidance_scale=2.5, output_type="latent")
            theirs = model(**calls[0])[0][:, :12]
            ours = fd.FluxCond(pe, pooled, km.pack_latents(ctx), (8, 6)).velocity(model, 2.5)(km.pack_latents(n),
                                                                                               calls[0]["timestep"])
    finally:
        handle.remove()
    assert torch.equal(calls[-1]["hidden_states"], calls[0]["hidden_states"])
    assert torch.equal(calls[-1]["img_ids"], calls[0]["img_ids"])
    assert torch.equal(ours, theirs)


def test_transformer_forward_without_guidance_embeds():
    model = tiny_flux(0, in_channels=4 * LATENT_C)
    x0, ctx, n = _batch()
    inputs = km.build_model_inputs(x0, ctx, n, torch.full((2,), 0.5))
    pe, pooled = text_inputs(2)
    with torch.no_grad():
        out = km.transformer_forward(model, inputs, torch.full((2,), 0.5), 1.0, pe, pooled)
    assert out.shape == inputs["hidden_states"].shape and torch.isfinite(out).all()
