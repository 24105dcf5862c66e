"""Independent checks of the DMD2 math in algorithms/dmd2.py on a tiny random diffusers UNet (CPU).

    python -m pytest tests/test_dmd2.py -q
"""
import copy
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from algorithms import dmd2 as dm
from tests.conftest import tiny_unet
from tests.numerics import THREADS, assert_within, gamma, unit_roundoff, threads_as_started  # noqa: F401 (autouse)

U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)

ROOT = Path(__file__).resolve().parents[1]

diffusers = pytest.importorskip("diffusers")

B, C, H, W, L, D = 2, 4, 8, 8, 7, 32  # batch, latent channels, latent size, text tokens, text dim


@pytest.fixture(scope="module")
def alphas():
    sched = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                    beta_start=0.00085, beta_end=0.012)
    return sched.alphas_cumprod


@pytest.fixture(scope="module")
def unets():
    return tiny_unet(seed=0).eval(), tiny_unet(seed=1).eval()


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(123)
    return {
        "x": torch.randn(B, C, H, W, generator=g),
        "noise": torch.randn(B, C, H, W, generator=g),
        "cond": torch.randn(B, L, D, generator=g),
        "uncond": torch.randn(1, L, D, generator=g),
        "t": torch.tensor([37, 901]),
    }


def eps_of(unet, z, t, emb):
    with torch.no_grad():
        return unet(z, t, encoder_hidden_states=emb, return_dict=False)[0].float()


def test_runs_on_the_thread_count_it_was_given():
    """OMP_NUM_THREADS reaches these tests, above the core count too (.ci/run runs this file at 1
    and 3 threads)."""
    want = os.environ.get("OMP_NUM_THREADS", "")
    assert torch.get_num_threads() == (int(want) if want.isdigit() and int(want) > 0 else THREADS)


# ---------------------------------------------------------------- 4. schedule and timesteps

def test_sd15_alphas(alphas):
    assert alphas[999].item() == pytest.approx(0.004660, abs=1e-6)
    assert alphas[20].item() == pytest.approx(0.981314, abs=1e-6)


def test_add_noise_x0_round_trip(alphas):
    g = torch.Generator().manual_seed(0)
    x0, n = torch.randn(5, C, H, W, generator=g), torch.randn(5, C, H, W, generator=g)
    t = torch.tensor([0, 20, 500, 980, 999])
    z = dm.add_noise(x0, n, t, alphas)
    a = alphas.double()[t].view(-1, 1, 1, 1)
    assert z.dtype == torch.float32
    exact = a.sqrt() * x0.double() + (1 - a).sqrt() * n.double()
    assert_within(z, exact, (U32 + 4 * U64) * exact.abs(), "add_noise")  # float64, one rounding to fp32
    back = dm.x0_from_eps(z, n, t, alphas)
    assert back.dtype == torch.float32
    # z's rounding amplified by 1/√ᾱ (14.6 at t = 999), then back's own; 2x for the float64 steps
    assert_within(back, x0, 2 * U32 * (z.double().abs() / a.sqrt() + x0.abs()), "x0_from_eps")
    # computed in float64: exact to float64 rounding on float64 inputs, for an int t as well as per-sample t;
    # a handful of roundings of each term, the same 1/√ᾱ amplification
    z64 = dm.add_noise(x0.double(), n.double(), 999, alphas)
    a999 = alphas.double()[999]
    assert_within(dm.x0_from_eps(z64, n.double(), 999, alphas), x0.double(),
                  8 * U64 * ((z64.abs() + n.double().abs()) / a999.sqrt() + x0.double().abs()), "float64")
    assert dm.x0_from_eps(z.bfloat16(), n.bfloat16(), t, alphas).dtype == torch.float32


def test_dm_and_fake_timestep_ranges():
    g = torch.Generator().manual_seed(0)
    t = dm.sample_dm_timesteps(20000, g)
    assert t.dtype == torch.long and t.shape == (20000,)
    assert t.min().item() == 20 and t.max().item() == 980  # inclusive on both ends
    f = dm.sample_fake_timesteps(20000, g, 1000)
    assert f.min().item() == 0 and f.max().item() == 999


# ---------------------------------------------------------------- 1. identical nets, s = 1

def test_identical_nets_guidance_one_give_zero(unets, data, alphas):
    gen_unet, teacher = unets
    real, fake = teacher, copy.deepcopy(teacher)
    x = dm.generator_forward(gen_unet, data["noise"], 999, data["cond"], alphas)
    assert x.requires_grad and x.dtype == torch.float32
    grad, diag = dm.dm_grad(x, data["t"], torch.randn_like(x), real, fake, data["cond"],
                            data["uncond"], 1.0, alphas)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert diag["p_real_abs_mean"].shape == (B,) and (diag["p_real_abs_mean"] > 0).all()
    loss = dm.dm_loss(x, grad)
    assert loss.item() == 0.0
    gen_unet.zero_grad(set_to_none=True)
    x_leaf = x.detach().requires_grad_(True)
    dm.dm_loss(x_leaf, grad).backward()
    assert torch.equal(x_leaf.grad, torch.zeros_like(x_leaf))
    loss.backward()
    grads = [p.grad for p in gen_unet.parameters()]
    assert all(g is not None for g in grads)
    assert all(torch.count_nonzero(g) == 0 for g in grads)
    gen_unet.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- 2. autograd vs closed form

def test_dm_loss_gradient_is_grad_over_numel(unets, data, alphas):
    real, fake = unets
    grad, _ = dm.dm_grad(data["x"], data["t"], data["noise"], real, fake, data["cond"],
                         data["uncond"], 1.75, alphas)
    assert grad.abs().sum() > 0 and not grad.requires_grad
    x = data["x"].clone().requires_grad_(True)
    loss = dm.dm_loss(x, grad)
    loss.backward()
    # x − (x − grad) in fp32 keeps the rounding of x − grad, u·|x − grad|: far above u·|grad| where
    # |grad| << |x|. The difference, 2/numel and the two products round on the order of |grad|:
    # per element (u·|x − grad| + 4u·|grad|) / numel, 2x for the second-order terms.
    xd, g, n = data["x"].double(), grad.double(), grad.numel()
    diff_err = U32 * ((xd - g).abs() + g.abs())  # |fl(x − fl(x − grad)) − grad| per element
    assert_within(x.grad, g / n, 2 * (diff_err + 3 * U32 * g.abs()) / n, "d loss / dx")
    # loss = 0.5·mean(d²), d as above: d² errs by 2|g|·diff_err + u·d² per element, the sum of
    # numel positive terms by gamma(numel) of itself in any order (threads split it), then the mean
    ref = 0.5 * g.pow(2).mean()
    bound = 0.5 * (2 * g.abs() * diff_err + U32 * g.pow(2)).mean() + (gamma(n) + 2 * U32) * ref
    assert_within(loss, ref, 2 * bound, "loss")


# ---------------------------------------------------------------- 3. CFG closed form

def test_cfg_numerator_closed_form(unets, data, alphas):
    teacher = unets[1]
    s, x, n, t, c, u = 1.75, data["x"], data["noise"], data["t"], data["cond"], data["uncond"]
    grad, diag = dm.dm_grad(x, t, n, teacher, copy.deepcopy(teacher), c, u, s, alphas)

    a = alphas.double()[t].view(-1, 1, 1, 1)
    z = (a.sqrt() * x.double() + (1 - a).sqrt() * n.double()).float()
    assert torch.equal(z, diag["z_t"])  # the same float64 formula, one rounding
    # the teacher's [uncond; cond] call, batched by hand, and the fake score's (the same weights) on
    # the cond batch alone: on some kernels a row's result depends on the batch it is in
    eps_u, eps_c = eps_of(teacher, torch.cat([z, z]), torch.cat([t, t]),
                          torch.cat([u.expand(B, -1, -1), c])).double().chunk(2)
    eps_fake = eps_of(teacher, z, t, c).double()
    k = ((1 - a) / a).sqrt()
    # p_real − p_fake = x̂0_fake − x̂0_real = k·(ε_real − ε_fake)
    #                = k·((s − 1)·(ε_c − ε_u) + (ε_c − ε_fake))
    numerator = k * ((s - 1) * (eps_c - eps_u) + (eps_c - eps_fake))
    x0_real = (z.double() - (1 - a).sqrt() * (eps_u + s * (eps_c - eps_u))) / a.sqrt()
    norm = (x.double() - x0_real).abs().mean(dim=(1, 2, 3), keepdim=True)

    # dm_grad forms ε_real = ε_u + s·(ε_c − ε_u) in fp32 (three roundings; the rest is float64):
    # an error of u·(2s·|ε_c − ε_u| + |ε_real|), scaled by k in the numerator and in p_real, whose
    # mean is the norm. Each fp32 output adds its own rounding; 2x for second-order terms.
    eps_real = eps_u + s * (eps_c - eps_u)
    num_err = k * U32 * (2 * s * (eps_c - eps_u).abs() + eps_real.abs())
    norm_err = num_err.mean(dim=(1, 2, 3), keepdim=True)
    assert_within(diag["p_real_abs_mean"], norm.flatten(), 2 * (norm_err + U32 * norm).flatten(), "norm")
    recovered = grad.double() * diag["p_real_abs_mean"].double().view(-1, 1, 1, 1)
    assert_within(recovered, numerator, 2 * (num_err + 2 * U32 * numerator.abs()), "grad · norm")
    closed = numerator / norm
    assert_within(grad, closed, 2 * (num_err / norm + closed.abs() * norm_err / norm + U32 * closed.abs()), "grad")


def test_cfg_combine_none_and_token_are_the_plain_and_the_pipelines_combination():
    """none: u + s·(c − u) as published; token: that combination rescaled per token (its vector along
    `dim`) to the conditional prediction's norm, the pipeline's arithmetic, against a float64 reference."""
    g = torch.Generator().manual_seed(0)
    s, d = 4.0, 64
    c, u = torch.randn(3, 5, d, generator=g), torch.randn(3, 5, d, generator=g)
    assert torch.equal(dm.cfg_combine(c, u, s), u + s * (c - u))
    comb64 = u.double() + s * (c.double() - u.double())
    ratio = c.double().norm(dim=-1, keepdim=True) / comb64.norm(dim=-1, keepdim=True)
    ref = comb64 * ratio
    # comb in fp32: three roundings of values up to |u| + s|c − u|; each norm: a sum of d squares (gamma(d)
    # relative, the squares' rounding in it), then a square root and the division: a few u more
    comb_err = 3 * U32 * (u.abs() + s * (c - u).abs()).double()
    ratio_rel = gamma(d + 4) + (comb_err.square().sum(-1, keepdim=True).sqrt() / comb64.norm(dim=-1, keepdim=True))
    out = dm.cfg_combine(c, u, s, "token")
    assert_within(out, ref, ratio * comb_err + ref.abs() * (ratio_rel + U32), "token")
    assert_within(out.double().norm(dim=-1), c.double().norm(dim=-1),
                  c.double().norm(dim=-1) * 2 * (ratio_rel.squeeze(-1) + gamma(d)), "each token keeps |c|")
    # the UNet layout (B, C, h, w): a pixel's channels
    cu, uu = c.transpose(1, 2), u.transpose(1, 2)
    assert_within(dm.cfg_combine(cu, uu, s, "token", dim=1), ref.transpose(1, 2),
                  (ratio * comb_err + ref.abs() * (ratio_rel + U32)).transpose(1, 2), "token, dim 1")


def test_cfg_combine_scalar_is_one_ratio_per_sample_capped_at_one():
    """scalar: each sample times min(1, |c| / |comb|) over all its elements: a sample whose combination
    is 7c comes back as c, one whose combination is c / 4 stays as it is, whatever the batch holds."""
    g = torch.Generator().manual_seed(1)
    c = torch.randn(2, 6, 8, generator=g)
    u = torch.stack([-c[0], 1.25 * c[1]])  # s = 4: comb = 7 c (ratio 1/7) and 0.25 c (ratio 4, capped)
    out = dm.cfg_combine(c, u, 4.0, "scalar")
    comb = u + 4.0 * (c - u)
    assert torch.equal(out[1], comb[1])  # the cap: times exactly 1
    # out[0] = comb·(|c| / |comb|): the norms each gamma(48) relative, the products a few u more
    assert_within(out[0], c[0], c[0].abs().double() * (2 * gamma(48 + 4) + 16 * U32), "ratio 1/7")
    alone = dm.cfg_combine(c[:1], u[:1], 4.0, "scalar")  # a rank holding only this sample
    assert_within(alone[0], out[0], out[0].abs().double() * 2 * gamma(48 + 4), "per sample")
    with pytest.raises(ValueError, match="one of none, token, scalar"):
        dm.cfg_combine(c, u, 4.0, "layer")


def test_dm_grad_combines_the_teachers_pair_by_its_norm(unets, data, alphas, monkeypatch):
    """dm_grad hands the teacher's (ε_c, ε_u) to cfg_combine with the scale, the norm and the channel dim."""
    seen = []
    plain = dm.cfg_combine
    monkeypatch.setattr(dm, "cfg_combine", lambda c, u, s, norm, dim: seen.append((s, norm, dim)) or plain(c, u, s))
    dm.dm_grad(data["x"], data["t"], data["noise"], unets[0], unets[1], data["cond"], data["uncond"], 1.75, alphas,
               "token")
    assert seen == [(1.75, "token", 1)]


def test_dm_grad_nonfinite_set_to_zero(data, alphas):
    def nan_unet(z, t, encoder_hidden_states=None, return_dict=False):
        return (torch.full_like(z, float("nan")),)

    grad, _ = dm.dm_grad(data["x"], data["t"], data["noise"], nan_unet, nan_unet, data["cond"],
                         data["uncond"], 1.75, alphas)
    assert torch.equal(grad, torch.zeros_like(grad))


# ---------------------------------------------------------------- 5. fake score loss

def test_fake_score_loss_by_hand_and_detached(unets, data, alphas):
    gen_unet, fake = unets[0], copy.deepcopy(unets[1]).train()
    x = dm.generator_forward(gen_unet, data["noise"], 999, data["cond"], alphas)
    n = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    t = torch.tensor([0, 999])
    loss = dm.fake_score_loss(fake, x, n, t, data["cond"], alphas)

    a = alphas.double()[t].view(-1, 1, 1, 1)
    z = (a.sqrt() * x.detach().double() + (1 - a).sqrt() * n.double()).float()
    # the fake score's own call (train mode, with autograd), so that ε̂ is the loss's, bit for bit
    eps = fake(z, t, encoder_hidden_states=data["cond"], return_dict=False)[0].detach()
    sq = (eps.double() - n.double()) ** 2
    # fp32: the difference and the square round by 3u·d² per element, the sum of numel positive
    # terms by gamma(numel) in any order, the mean by u; 2x for second-order terms
    assert_within(loss.detach(), sq.mean(), 2 * (4 * U32 + gamma(sq.numel())) * sq.mean(), "fake score loss")

    gen_unet.zero_grad(set_to_none=True)
    loss.backward()
    assert all(p.grad is None for p in gen_unet.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in fake.parameters())


# ---------------------------------------------------------------- 6. GAN head and losses

def test_classifier_head_structure_matches_official():
    with torch.device("meta"):  # structure only; skips initialising 2 × 26 M weights
        head = dm.ClassifierHead(1280)
    convs = [(m.kernel_size, m.stride, m.padding, m.out_channels)
             for m in head if isinstance(m, torch.nn.Conv2d)]
    assert convs == [((4, 4), (2, 2), (1, 1), 1280), ((4, 4), (4, 4), (0, 0), 1280),
                     ((1, 1), (1, 1), (0, 0), 1)]
    assert [type(m).__name__ for m in head] == ["Conv2d", "GroupNorm", "SiLU", "Conv2d",
                                                "GroupNorm", "SiLU", "Conv2d"]
    assert head[1].num_groups == 32 and dm.ClassifierHead(320)[1].num_groups == 32  # official at C >= 256
    # small C: groups of >= 8 channels (64 -> 8 groups, 48 -> 6, 32 -> 4, 16 -> 2, 4 -> 1)
    assert [dm.head_norm_groups(c) for c in (64, 48, 32, 16, 4)] == [8, 6, 4, 2, 1]


def test_small_head_logit_is_not_a_sum_of_signs():
    """The 1×1 GroupNorm of a small head (C = 64 or 32, the demo's bottleneck and up path) passes a
    smooth function of its input: logits vary with the features and their gradient is bounded.
    With the official 32 groups it was a sign per channel pair (C = 64) or constant (C = 32)."""
    for c in (64, 32):
        torch.manual_seed(0)
        head = dm.ClassifierHead(c)
        x = torch.randn(16, c, 8, 8, requires_grad=True)
        logits = head(x)
        logits.sum().backward()
        assert logits.std() > 1e-2, c
        assert 0 < x.grad.norm() < 10, (c, x.grad.norm())
        # the 1×1 GroupNorm's outputs are not reduced to signs (±1) or zeros
        normed = torch.nn.Sequential(*list(head)[:5])(x.detach())
        assert ((normed.abs() - 1).abs() > 0.1).float().mean() > 0.5, c
    assert set(head.state_dict()) == {f"{i}.{k}" for i in (0, 1, 3, 4, 6) for k in ("weight", "bias")}


def test_classifier_head_any_bottleneck_size():
    torch.manual_seed(0)
    head = dm.ClassifierHead(64)
    feats8 = torch.randn(3, 64, 8, 8)
    direct = torch.nn.Sequential(*head)(feats8).flatten(1)  # native 8×8: no pooling
    torch.testing.assert_close(head(feats8), direct)
    for size in (1, 2, 4, 16):
        assert head(torch.randn(3, 64, size, size)).shape == (3, 1)


def test_head_on_tiny_unet_bottleneck(unets, data, alphas):
    unet = copy.deepcopy(unets[1])
    x = data["x"].clone().requires_grad_(True)
    feats = dm.bottleneck_features(unet, x, 0, data["cond"])
    assert feats.shape == (B, 64, 4, 4)
    assert len(unet.mid_block._forward_hooks) == 0  # hook removed
    head = dm.ClassifierHead(64)
    logits = dm.cls_logits(unet, head, x, 0, data["cond"])
    assert logits.shape == (B, 1) and logits.dtype == torch.float32
    dm.gen_cls_loss(logits).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert head[6].weight.grad is not None


def _mid_output_of_full_forward(unet, x, t, cond):
    """What the head read before: the mid block's output captured while the whole UNet ran."""
    captured = []
    handle = unet.mid_block.register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        unet(x, torch.full((x.shape[0],), t), return_dict=False, **dm.cond_kwargs(cond))
    finally:
        handle.remove()
    return captured[0]


def test_bottleneck_stops_after_the_mid_block_with_identical_values_and_grads(unets, data):
    """The head's features come from the UNet's forward cut after the mid block (no up block
    runs), bit-identical to the mid block's output in a full forward, with the same gradients for
    the input and the down/mid weights; the UNet is whole again afterwards."""
    unet = copy.deepcopy(unets[1])
    calls = []
    hooks = [b.register_forward_hook(lambda *a: calls.append(1)) for b in unet.up_blocks]
    grads = []
    for features in (lambda x: dm.bottleneck_features(unet, x, 7, data["cond"]),
                     lambda x: _mid_output_of_full_forward(unet, x, 7, data["cond"])):
        unet.zero_grad(set_to_none=True)
        x = data["x"].clone().requires_grad_(True)
        f = features(x)
        (f.double() ** 2).sum().backward()
        grads.append((f.detach(), x.grad, unet.down_blocks[0].resnets[0].conv1.weight.grad,
                      unet.mid_block.resnets[1].conv2.weight.grad))
        if not calls:
            assert unet.up_blocks[0].resnets[0].conv1.weight.grad is None and unet.conv_out.weight.grad is None
            calls.append("full")  # the next pass is the full forward: up blocks run there
    for cut, full in zip(*grads):
        assert torch.equal(cut, full)
    assert calls == ["full", 1, 1]  # only the full forward ran the two up blocks
    for h in hooks:
        h.remove()
    assert isinstance(unet.conv_out, torch.nn.Conv2d) and len(unet.up_blocks) == 2
    assert unet(data["x"], 7, data["cond"]).sample.shape == data["x"].shape


def test_diffusion_gan_noise(alphas):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, C, H, W)
    z, t = dm.diffusion_gan_noise(x, 10, alphas, g)
    assert z.shape == x.shape and t.shape == (64,) and t.min() >= 0 and t.max() < 10
    assert not torch.equal(z, x)


def test_gan_losses_hand_formulas():
    fake = torch.tensor([[-2.0], [0.0], [3.0]])
    real = torch.tensor([[1.0], [-0.5], [0.25]])
    sp = lambda v: torch.log1p(torch.exp(v))  # noqa: E731
    torch.testing.assert_close(dm.gen_cls_loss(fake), sp(-fake).mean())
    torch.testing.assert_close(dm.guidance_cls_loss(fake, real), sp(fake).mean() + sp(-real).mean())
    assert dm.gen_cls_loss(torch.zeros(4, 1)).item() == pytest.approx(torch.log(torch.tensor(2.0)).item())


# ---------------------------------------------------------------- 7. backward simulation

class CountingUnet:
    def __init__(self, unet):
        self.unet, self.calls, self.timesteps = unet, 0, []

    def __call__(self, z, t, **kw):
        self.calls += 1
        self.timesteps.append(t.tolist())
        return self.unet(z, t, **kw)


def test_backward_simulation(unets, data, alphas):
    steps = dm.denoising_step_list(4)
    assert steps == [999, 749, 499, 249] and dm.denoising_step_list(1) == [999]
    noise = data["noise"]
    for k in range(len(steps)):
        counter = CountingUnet(unets[0])
        z, forwards = dm.backward_simulation(counter, noise, steps, k, data["cond"], alphas,
                                             torch.Generator().manual_seed(5))
        assert forwards == counter.calls == k
        assert counter.timesteps == [[s] * B for s in steps[:k]]
        assert z.shape == noise.shape and not z.requires_grad
        if k == 0:
            assert z is noise

    # index 1 by hand: x0 at 999, re-noised to 749 with the generator's next draw
    z1, _ = dm.backward_simulation(unets[0], noise, steps, 1, data["cond"], alphas,
                                   torch.Generator().manual_seed(5))
    x0 = dm.x0_from_eps(noise, eps_of(unets[0], noise, torch.full((B,), 999), data["cond"]), 999, alphas)
    fresh = torch.randn(noise.shape, generator=torch.Generator().manual_seed(5))
    a = alphas.double()[749]
    torch.testing.assert_close(z1, (a.sqrt() * x0.double() + (1 - a).sqrt() * fresh.double()).float())


def test_choose_step_index_same_on_all_ranks_and_covers_all():
    def rank_indices(rank):  # a "rank" with its own global RNG state
        torch.manual_seed(rank)
        random.seed(rank)
        return [dm.choose_step_index(step, seed=42, n_steps=4) for step in range(400)]

    r0, r1 = rank_indices(0), rank_indices(1)
    assert r0 == r1
    assert set(r0) == {0, 1, 2, 3}
    assert r0 != [dm.choose_step_index(step, seed=43, n_steps=4) for step in range(400)]
    # a separate process with different hash randomisation agrees
    code = "from algorithms import dmd2 as d; print([d.choose_step_index(s, 42, 4) for s in range(400)])"
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == str(r0)


# ---------------------------------------------------------------- 8. update schedule

def test_should_update_generator():
    assert [s for s in range(35) if dm.should_update_generator(s, 10)] == [0, 10, 20, 30]
    assert all(dm.should_update_generator(s, 1) for s in range(20))
    with pytest.raises(ValueError):
        dm.should_update_generator(0, 0)


def test_up_features_are_the_last_up_block_output_and_feed_an_up_head(unets, data):
    """features="up": the UNet's forward without its output layers returns the last up block's
    output (bit-identical values and input grads to a hook on a full forward), the UNet is whole
    afterwards, and cls_logits routes an "up" head to these features (32 ch at the latent side)."""
    unet = copy.deepcopy(unets[1])
    x = data["x"].clone().requires_grad_(True)
    feats = dm.up_features(unet, x, 7, data["cond"])
    (feats.double() ** 2).sum().backward()
    x2 = data["x"].clone().requires_grad_(True)
    captured = []
    handle = unet.up_blocks[-1].register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        full = unet(x2, torch.full((B,), 7), return_dict=False, **dm.cond_kwargs(data["cond"]))[0]
    finally:
        handle.remove()
    (captured[0].double() ** 2).sum().backward()
    assert feats.shape == (B, 32, H, W) and torch.equal(feats, captured[0]) and torch.equal(x.grad, x2.grad)
    assert unet.conv_norm_out is not None and full.shape == x.shape  # restored
    head = dm.ClassifierHead(32, native_size=H, features="up")
    assert head.features == "up" and set(head.state_dict()) == set(dm.ClassifierHead(32, native_size=H).state_dict())
    torch.testing.assert_close(dm.cls_logits(unet, head, x, 7, data["cond"]), head(feats.float()))
    with pytest.raises(ValueError, match="features"):
        dm.ClassifierHead(32, features="down")


# ---------------------------------------------------------------- bottleneck under FSDP2

def test_bottleneck_features_under_fsdp2(tmp_path):
    """The mid-block hook sees the same features, and gradients flow, once the UNet is sharded
    with fully_shard (1-rank gloo group, in process)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this session")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        unet = tiny_unet(seed=0).eval()
        x, c = torch.randn(B, C, H, W, requires_grad=True), torch.randn(B, L, D)
        ref = dm.bottleneck_features(unet, x, 0, c).detach()
        for block in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
            fully_shard(block)
        fully_shard(unet)
        feats = dm.bottleneck_features(unet, x, 0, c)
        torch.testing.assert_close(feats, ref, rtol=1e-5, atol=1e-5)
        dm.gen_cls_loss(dm.ClassifierHead(64)(feats.float())).backward()
        assert x.grad.abs().sum() > 0
        assert unet.mid_block.resnets[0].conv1.weight.grad is not None
        up_ref = dm.up_features(tiny_unet(seed=0).eval(), x, 0, c).detach()
        torch.testing.assert_close(dm.up_features(unet, x, 0, c), up_ref, rtol=1e-5, atol=1e-5)
        assert unet(x, 0, c).sample.shape == x.shape  # the sharded UNet's full forward still works after
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- SDXL conditioning

def tiny_sdxl_unet(seed: int):
    torch.manual_seed(seed)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, norm_num_groups=8, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 16).eval()


def sdxl_cond(batch: int, seed: int) -> "dm.Cond":
    g = torch.Generator().manual_seed(seed)
    return dm.Cond(torch.randn(batch, 5, 64, generator=g),
                   {"text_embeds": torch.randn(batch, 16, generator=g),
                    "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]).repeat(batch, 1)})


def test_sdxl_dm_loss_bar_and_cfg_use_the_added_conditions(alphas):
    """The published bar holds for SDXL's conditioning too: identical real and fake UNets at
    guidance 1 give grad ≡ 0 and loss_dm exactly 0; with s > 1 the [uncond; cond] batch carries the
    added conditions row by row (zeros for the unconditional half, as the official SDXL code)."""
    unet = tiny_sdxl_unet(0)
    cond = sdxl_cond(B, 1)
    uncond = dm.Cond(torch.zeros(1, 5, 64), {"text_embeds": torch.zeros(1, 16), "time_ids": cond.added["time_ids"][:1]})
    x = dm.generator_forward(tiny_sdxl_unet(1), torch.randn(B, 4, 8, 8), 999, cond, alphas)
    t, noise = torch.randint(20, 980, (B,)), torch.randn(B, 4, 8, 8)
    grad, _ = dm.dm_grad(x, t, noise, unet, copy.deepcopy(unet), cond, uncond, 1.0, alphas)
    assert torch.equal(grad, torch.zeros_like(grad)) and dm.dm_loss(x, grad).item() == 0.0
    # s > 1: the teacher's CFG equals its [uncond; cond] batch built by hand, each added condition row by row
    grad_cfg, diag = dm.dm_grad(x, t, noise, unet, copy.deepcopy(unet), cond, uncond, 8.0, alphas)
    z = diag["z_t"]
    added = {k: torch.cat([uncond.added[k].expand(B, -1), v]) for k, v in cond.added.items()}
    with torch.no_grad():
        eps_u, eps_c = unet(torch.cat([z, z]), torch.cat([t, t]), encoder_hidden_states=torch.cat(
            [uncond.text.expand(B, -1, -1), cond.text]), added_cond_kwargs=added, return_dict=False)[0].chunk(2)
    eps_u, eps_c = eps_u.double(), eps_c.double()
    x0_real = dm.x0_from_eps(z, eps_u + 8.0 * (eps_c - eps_u), t, alphas, out_dtype=torch.float64)
    # dm_grad forms ε_real in fp32: u·(2s·|ε_c − ε_u| + |ε_real|), times √(1 − ᾱ)/√ᾱ in x̂0, then
    # x̂0's rounding to fp32; 2x for second-order terms
    a = alphas.double()[t].view(-1, 1, 1, 1)
    eps_err = U32 * (16 * (eps_c - eps_u).abs() + (eps_u + 8 * (eps_c - eps_u)).abs())
    assert_within(diag["x0_real"], x0_real, 2 * (((1 - a) / a).sqrt() * eps_err + U32 * x0_real.abs()), "x0_real")
    assert grad_cfg.abs().sum() > 0
    # the added conditions matter (a UNet ignoring them would pass the checks above)
    other = dm.Cond(cond.text, {**cond.added, "text_embeds": torch.zeros_like(cond.added["text_embeds"])})
    assert not torch.allclose(dm.predict_eps(unet, diag["z_t"], t, cond), dm.predict_eps(unet, diag["z_t"], t, other))


def test_sdxl_classifier_head_matches_the_official_layout():
    """SDXL: three stride-2 stages (32 -> 4) then the SD-1.5 tail: 13 modules, (B, 1) logits."""
    head = dm.ClassifierHead(64, native_size=32)
    assert len(head) == 13 and [type(m).__name__ for m in list(head)[:3]] == ["Conv2d", "GroupNorm", "SiLU"]
    assert head(torch.randn(2, 64, 32, 32)).shape == (2, 1)
    assert head(torch.randn(2, 64, 4, 4)).shape == (2, 1)  # a small bottleneck is pooled up to 32
    assert len(dm.ClassifierHead(64)) == 7  # SD-1.5's, unchanged
    with pytest.raises(ValueError, match="power of two"):
        dm.ClassifierHead(64, native_size=12)


def test_warmup_is_the_published_schedule_for_both_optimizers():
    """LR at (0-based) iteration k = LR·min(1, k·P/500) in the official code (P GPUs, schedulers
    stepped every iteration, accelerate stepping P times per call); here WARMUP_STEPS = 500/P
    iterations, the factor min(1, k / WARMUP_STEPS), the generator's schedule advancing also on
    iterations where it does not update."""
    import train_dmd
    gen, fake = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    warmup = 500 / 64
    (opt_g, sched_g), (opt_d, sched_d) = (train_dmd.make_optimizer(m, 1e-5, warmup) for m in (gen, fake))
    for k in range(12):
        published = 1e-5 * min(1.0, k * 64 / 500)
        assert sched_g.get_last_lr()[0] == pytest.approx(published, rel=1e-12, abs=0)
        assert sched_d.get_last_lr()[0] == pytest.approx(published, rel=1e-12, abs=0)
        if k % 10 == 0:  # the generator steps only every DFAKE_GEN_UPDATE_RATIO iterations ...
            opt_g.step()
        opt_d.step()
        sched_g.step()  # ... but both schedules advance every iteration, as the training loop does
        sched_d.step()


# ----------------------------------------------------------------------------------------------
# the flow-matching form (FLUX.1): x_σ = (1 − σ)·x0 + σ·n, v = n − x0


def _velocity(weight: float):
    """A deterministic stand-in model: v = weight · x_σ (any function of x_σ and σ works here)."""
    return lambda x_sigma, sigma: weight * x_sigma


def test_fm_dm_grad_is_zero_when_teacher_and_fake_agree():
    g = torch.Generator().manual_seed(0)
    x, n = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    sigma = dm.sample_dm_sigmas(3, g)
    grad, diag = dm.fm_dm_grad(x, sigma, n, _velocity(0.7), _velocity(0.7))
    assert torch.count_nonzero(grad) == 0 and diag["grad_norm"] == 0
    assert float(dm.dm_loss(x, grad)) == 0.0


def test_fm_dm_grad_closed_form():
    """p_real − p_fake = x̂0_fake − x̂0_real = σ·(v_real − v_fake), divided per sample by mean|p_real|."""
    g = torch.Generator().manual_seed(1)
    x, n = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigma = torch.tensor([0.25, 0.8])
    real, fake = _velocity(1.0), _velocity(0.5)
    grad, diag = dm.fm_dm_grad(x, sigma, n, real, fake)
    x_sigma = (1 - sigma.view(-1, 1, 1, 1)) * x + sigma.view(-1, 1, 1, 1) * n
    p_real = x.double() - (x_sigma.double() - sigma.view(-1, 1, 1, 1).double() * real(x_sigma, sigma).double())
    expected = sigma.view(-1, 1, 1, 1).double() * (real(x_sigma, sigma) - fake(x_sigma, sigma)).double()
    expected = expected / p_real.abs().mean(dim=(1, 2, 3), keepdim=True)
    torch.testing.assert_close(grad, expected.float())
    torch.testing.assert_close(diag["p_real_abs_mean"], p_real.abs().mean(dim=(1, 2, 3)).float())


def test_fm_x0_and_noise_invert_each_other():
    g = torch.Generator().manual_seed(2)
    x0, n = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    sigma = torch.tensor([0.1, 0.9])
    x_sigma = dm.fm_noise(x0, n, sigma)
    # the true velocity; fp32 x_σ (1 − σ, two products, the sum) and n − x0 round by at most
    # u·(|x0| + |n|) each, the float64 x̂0 once more on the way back to fp32; 2x for second-order terms
    assert_within(dm.x0_from_velocity(x_sigma, n - x0, sigma).float(), x0, 2 * 6 * U32 * (x0.abs() + n.abs()), "x0")


def test_fm_fake_score_loss_is_zero_at_the_true_velocity_and_never_reaches_the_generator():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 4, 4, generator=g, requires_grad=True)
    n, sigma = torch.randn(2, 4, 4, 4, generator=g), torch.tensor([0.3, 0.6])
    s = sigma.view(-1, 1, 1, 1)
    true = lambda x_sigma, sig: (x_sigma - x.detach()) / s  # noqa: E731 - v = n − x, from x_σ
    assert float(dm.fm_fake_score_loss(true, x, n, sigma)) == pytest.approx(0.0, abs=1e-10)
    w = torch.nn.Parameter(torch.tensor(0.5))
    loss = dm.fm_fake_score_loss(lambda x_sigma, sig: w * x_sigma, x, n, sigma)
    loss.backward()
    assert w.grad is not None and x.grad is None


def test_fm_fake_score_loss_on_x0_is_the_velocity_error_weighted_by_sigma_squared():
    """x_σ − σ·v̂ − x = σ·((n − x) − v̂): the x0 target is the flow loss with each sample's terms
    × σ²."""
    g = torch.Generator().manual_seed(5)
    x, n = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    sigma = torch.tensor([0.05, 0.5, 0.95])
    fake = lambda x_sigma, sig: 0.5 * x_sigma + 0.1  # noqa: E731 - any wrong velocity
    got = dm.fm_fake_score_loss(fake, x, n, sigma, target="x0")
    s = sigma.double().view(-1, 1, 1, 1)
    v = fake(dm.fm_noise(x, n, sigma), sigma).double()
    r = s * (n.double() - x.double() - v)  # the x0 residual in float64
    # fp32: x_σ (two products, a sum), σ·v̂ and the two differences round by at most u·(|x| + |n| + |σ·v̂|)
    # each, 6 roundings; the square adds 2|r|·δ + δ², the mean averages the bound
    delta = 2 * 6 * U32 * (x.double().abs() + n.double().abs() + (s * v).abs())
    assert abs(float(got) - float((r ** 2).mean())) <= float((2 * r.abs() * delta + delta ** 2).mean())
    with pytest.raises(ValueError, match="fake-score target"):
        dm.fm_fake_score_loss(fake, x, n, sigma, target="eps")


def test_fm_teacher_ode_of_a_teacher_that_knows_the_sample_lands_on_it():
    """A teacher that always predicts the clean sample c (v = (x − c)/σ) has the straight path
    x_σ = c + σ·(n − c) as its ODE; Euler follows it exactly, so the regression target is c."""
    g = torch.Generator().manual_seed(6)
    c, n = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    teacher = lambda x, sigma: (x - c) / sigma.view(-1, 1, 1, 1)  # noqa: E731
    for steps in (1, 4, 28):
        # each step: a quotient, a product and two sums in fp32 on values within |n| + |c|, 4 roundings
        # relative to that; over the steps the error's component along (x − c) shrinks with σ, the last
        # step lands on x − (x − c); 2x for second-order terms
        bound = 2 * 4 * (steps + 1) * U32 * (n.abs() + c.abs())
        assert_within(dm.fm_teacher_ode(teacher, n, steps), c, bound, f"ODE, {steps} steps")
    x = torch.randn(2, 4, 4, 4, generator=g, requires_grad=True)
    loss = dm.regression_loss(x, c)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(((x.detach() - c) ** 2).mean()), rel=4 * x.numel() * U32)
    assert_within(x.grad, 2 * (x.detach() - c) / x.numel(), 8 * U32 * (x.detach().abs() + c.abs()) / x.numel(),
                  "regression gradient")


def test_fm_backward_simulation_renoises_each_prediction():
    """With a generator that always predicts the clean sample c (v = (x − c)/σ), each step's input
    is (1 − σ_{i+1})·c + σ_{i+1}·fresh noise; index 0 is the pure noise itself."""
    g = torch.Generator().manual_seed(4)
    c, noise = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g)
    fresh = [torch.randn(2, 4, 4, 4, generator=g) for _ in range(3)]
    sigmas = [1.0, 0.75, 0.5, 0.25]

    def gen(x, sigma):
        return (x - c) / sigma.view(-1, 1, 1, 1)
    x, forwards = dm.fm_backward_simulation(gen, noise, sigmas, 0, fresh)
    assert forwards == 0 and torch.equal(x, noise)
    x, forwards = dm.fm_backward_simulation(gen, noise, sigmas, 2, fresh)
    assert forwards == 2
    # x̂0 = x − σ·(x − c)/σ is c whatever x was, to the roundings of x − c and the division (u·|x − c|
    # each, times σ) and of x̂0 (u·|c|); halved into x along with fresh noise, then x's own rounding
    # (u·|x|); x − c at σ = 0.75 is 0.75·(fresh[0] − c). 2x for second-order terms.
    want = 0.5 * c.double() + 0.5 * fresh[1].double()
    x0_err = U32 * (2 * 0.75 * (fresh[0] - c).abs() + c.abs())
    assert_within(x, want, 2 * (0.5 * x0_err + U32 * want.abs()), "x at index 2")
    with pytest.raises(ValueError):
        dm.fm_backward_simulation(gen, noise, sigmas, 4, fresh)
    s = dm.sample_dm_sigmas(1000, torch.Generator().manual_seed(5))
    assert 0.02 <= float(s.min()) and float(s.max()) <= 0.98


def test_the_two_steps_are_twins():
    """The ε-prediction step and the flow-matching step have the same functions with the same shape:
    generator_images(generator, mb, steps, index, ...), generator_loss(x, mb, teacher, fake, ..., losses),
    guidance_loss(x, mb, fake, ..., losses), draw_sample_noise(g, shape, n_sim, ...); one Losses for both."""
    import inspect

    from algorithms import dmd2_flow, dmd2_unet
    shapes = {"generator_images": ["generator", "mb", None, "index"], "generator_loss": ["x", "mb", "teacher", "fake"],
              "guidance_loss": ["x", "mb", "fake"], "draw_sample_noise": ["g", "shape", "n_sim"]}
    for module in (dmd2_unet, dmd2_flow):
        for name, head in shapes.items():
            params = inspect.signature(getattr(module, name)).parameters
            names = list(params)
            assert [n if h else None for n, h in zip(names, head)] == head, (module.__name__, name, names)
            if name.endswith("_loss"):
                assert names[-1] == "losses" and params["losses"].default == dm.Losses(), (module.__name__, name)
