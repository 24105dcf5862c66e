"""ATTENTION_BACKEND (parallel/attention.py): the name is checked, it reaches the models' attention
(diffusers' dispatcher for FLUX, torch's SDPA flags for the UNet), and the start-up self-check
catches a kernel that fails or computes wrong values.

    python -m pytest tests/test_attention.py -q
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.errors import ConfigError, LocalError
from families import flux, sd_unet
from parallel import attention
from tests.conftest import ROOT, launch, tiny_unet


@pytest.fixture
def restore_sdpa_flags():
    flags = ("flash_sdp", "mem_efficient_sdp", "math_sdp", "cudnn_sdp")
    before = [getattr(torch.backends.cuda, f"{f}_enabled")() for f in flags]
    yield
    for f, on in zip(flags, before):
        getattr(torch.backends.cuda, f"enable_{f}")(on)


def test_names_are_checked_in_one_line():
    assert attention.check_backend("", dispatcher_model=True) == "native"
    assert attention.check_backend("_NATIVE_MATH", dispatcher_model=False) == "_native_math"
    with pytest.raises(ConfigError, match=r"ATTENTION_BACKEND='flsh': unknown; installed here: native") as e:
        attention.check_backend("flsh", dispatcher_model=True)
    assert "\n" not in str(e.value)
    if "flash" not in attention.installed():  # flash-attn is a CUDA package
        with pytest.raises(ConfigError, match="'flash': not usable here"):
            attention.check_backend("flash", dispatcher_model=True)
    with pytest.raises(ConfigError, match="calls torch's SDPA directly"):
        attention.check_backend("flex", dispatcher_model=False)


def test_sdpa_flags_follow_the_name(restore_sdpa_flags):
    assert attention.sdpa_flags("native") == "flash+efficient+math"
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert attention.sdpa_flags("_native_cudnn") == "flash+efficient+math+cudnn"
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert attention.sdpa_flags("_native_math") == "math"
    assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
    assert attention.sdpa_flags("flex") == "flash+efficient+math"  # dispatcher-only: native's flags elsewhere


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


def test_sdpa_flags_reach_the_unet(restore_sdpa_flags):
    unet = tiny_unet().eval()
    x, t, text = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 6, 32)
    seen = {}
    for name in ("native", "_native_math"):
        attention.sdpa_flags(name)
        with torch.no_grad(), _Ops() as ops:
            unet(x, t, text)
        seen[name] = {n for n in ops.names if "flash" in n}
    assert seen["native"], "the UNet's attention should run torch's CPU flash kernel under native"
    assert not seen["_native_math"], seen


def test_the_backend_reaches_flux_attention(monkeypatch):
    from diffusers import FluxTransformer2DModel
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    folder = os.path.join(ROOT, "assets", "kontext_base", "transformer")
    model = FluxTransformer2DModel.from_pretrained(folder)
    attention.set_backend(model, "_native_math")
    assert attention.model_backends(model) == {"_native_math"}
    calls = []
    math_fn = _AttentionBackendRegistry._backends[AttentionBackendName._NATIVE_MATH]
    monkeypatch.setitem(_AttentionBackendRegistry._backends, AttentionBackendName._NATIVE_MATH,
                        lambda **kw: calls.append(1) or math_fn(**kw))
    c = model.config
    tokens, text = 4, 3
    with torch.no_grad():
        model(hidden_states=torch.randn(1, tokens, c.in_channels), timestep=torch.tensor([0.5]),
              guidance=torch.tensor([1.0]), encoder_hidden_states=torch.randn(1, text, c.joint_attention_dim),
              pooled_projections=torch.randn(1, c.pooled_projection_dim), txt_ids=torch.zeros(text, 3),
              img_ids=torch.zeros(tokens, 3))
    assert len(calls) == c.num_layers + c.num_single_layers  # every block's attention went through it


class SdpaDtypes(torch.overrides.TorchFunctionMode):
    """The dtypes of (q, k, v) at every F.scaled_dot_product_attention call under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.seen.append(tuple(t.dtype for t in args[:3]))
        return func(*args, **(kwargs or {}))


def _unet_fwd_bwd(unet):
    """Output and parameter grads of one forward + backward of a tiny UNet (fixed inputs)."""
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 6, 32, generator=g)
    out = unet(x, torch.tensor([10, 500]), text).sample
    out.square().mean().backward()
    return [out.detach()] + [p.grad for p in unet.parameters()]


def test_cast_processor_in_the_models_dtype_is_diffusers_own_bit_for_bit():
    """CastSdpaProcessor re-states AttnProcessor2_0: with no cast, the same values and grads."""
    import copy
    ref = tiny_unet()
    cast = copy.deepcopy(ref)
    cast.set_attn_processor(attention.CastSdpaProcessor(torch.float32))
    assert type(next(iter(ref.attn_processors.values()))).__name__ == "AttnProcessor2_0"
    assert all(torch.equal(a, b) for a, b in zip(_unet_fwd_bwd(ref), _unet_fwd_bwd(cast)))


def test_cast_processor_runs_sdpa_in_its_dtype_and_hands_back_the_models():
    """An fp32 UNet with bf16 attention: SDPA sees bf16 q, k, v at every call (each self- and
    cross-attention once), the output and the grads stay fp32, and the values stay within bf16's
    rounding of the fp32 model's."""
    import copy
    from precision import component_row
    ref = tiny_unet()
    fast = copy.deepcopy(ref)
    fast.set_attn_processor(attention.CastSdpaProcessor(torch.bfloat16))
    assert attention.sdpa_dtypes(fast) == {torch.bfloat16} and attention.sdpa_dtypes(ref) == set()
    with SdpaDtypes() as mode:
        got = _unet_fwd_bwd(fast)
    assert len(mode.seen) == len(fast.attn_processors) and set(mode.seen) == {(torch.bfloat16,) * 3}
    with SdpaDtypes() as mode:
        want = _unet_fwd_bwd(ref)
    assert set(mode.seen) == {(torch.float32,) * 3}
    assert all(t.dtype == torch.float32 for t in got)
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 per cast): q, k, v and the softmax round at
    # that size, so the output moves by a few 2^-9 of its norm, not more
    assert float((got[0] - want[0]).norm() / want[0].norm()) < 8 * 2**-9
    assert component_row("fake", fast, torch.float32)["compute"] == "fp32, attention bf16"
    assert component_row("generator", ref, torch.bfloat16)["compute"] == "bf16"


SHAPES = [attention.Shape("self", 2, 24, 24, 3, 16), attention.Shape("cross", 1, 20, 7, 2, 8),
          attention.Shape("frozen", 1, 16, 16, 1, 64, backward=False)]


def test_self_check_passes_on_the_cpu_kernels():
    for attend in (attention.sdpa_attend, attention.dispatcher_attend("native"),
                   attention.dispatcher_attend("_native_math")):
        lines = attention.self_check([(s, attend) for s in SHAPES], "native", torch.float32, torch.device("cpu"))
        assert len(lines) == 3 and "fwd+bwd" in lines[0] and lines[2].endswith(lines[2].split()[-1])


def test_self_check_fails_a_wrong_kernel_in_one_line():
    def zeros(q, k, v):
        return torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum())

    with pytest.raises(
        LocalError,
        match=r"ATTENTION_BACKEND=broken: the start-up check failed on self .* "
        r"relative error 1 in d?[qkvout]+ against .* use --attention_backend=native",
    ) as e:
        attention.self_check([(s, zeros) for s in SHAPES], "broken", torch.float32, torch.device("cpu"))
    assert "\n" not in str(e.value)

    def wrong_grad(q, k, v):  # right values, gradient scaled: only the backward comparison sees it
        out = attention.sdpa_attend(q, k, v)
        return out + 0.5 * (out - out.detach())

    with pytest.raises(LocalError, match=r"relative error 0.5 in d[qkv] "):
        attention.self_check([(SHAPES[0], wrong_grad)], "halfgrad", torch.float32, torch.device("cpu"))

    def crashes(q, k, v):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    with pytest.raises(LocalError, match=r"RuntimeError: CUDA error: an illegal memory access was encountered; use"
                       ) as e:
        attention.self_check([(SHAPES[1], crashes)], "_native_cudnn", torch.bfloat16, torch.device("cpu"))
    assert "more" not in str(e.value)


def test_shapes_are_the_runs_own():
    folder = os.path.join(ROOT, "assets", "kontext_base")
    trained, vae = flux.attention_shapes(folder, 12, [(32, 32), (32, 64)], 8, 3, 2)
    import json
    with open(os.path.join(folder, "transformer", "config.json")) as f:
        c = json.load(f)
    heads, dim = c["num_attention_heads"] // 2, c["attention_head_dim"]  # Ulysses: heads split 2 ways
    assert [(s.batch, s.q_len, s.heads, s.head_dim) for s in trained] == [(3, 12 + 2 * 4, heads, dim),
                                                                           (3, 12 + 2 * 8, heads, dim)]
    assert [(s.q_len, s.heads, s.backward) for s in vae] == [(16, 1, False), (32, 1, False)]
    sd = os.path.join(ROOT, "assets", "shapes_teacher")
    trained, vae = sd_unet.attention_shapes(sd, 0, 2)
    assert trained and all(s.backward for s in trained) and not vae[0].backward
    assert [(s.q_len, s.k_len) for s in trained if "cross" in s.what] == [(64, 16), (16, 16)]  # 16 text tokens
    assert (vae[0].q_len, vae[0].head_dim) == (64, 64)


@pytest.mark.slow
def test_a_bad_name_stops_the_script_in_one_line(tmp_path):
    r = launch("train_flux_kontext.py", ["--attention_backend=flashy", f"--output_dir={tmp_path}"], ranks=1,
               check=False)
    assert r.returncode == 2
    lines = [line for line in r.stdout.splitlines() if line.startswith("error:")]
    assert lines == [lines[0]] and "ATTENTION_BACKEND='flashy': unknown; installed here: native" in lines[0]
