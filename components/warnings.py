"""The filter for the warnings that are noise in these scripts (and only those).

    python -m pytest tests/test_train_flux_kontext.py -q
"""
from __future__ import annotations

import logging
import warnings

def quiet_known_warnings() -> None:
    """Silence the warnings that are noise in these scripts, and only those:
    - FSDP2 warns when a wrapped block returns a view (FLUX blocks return slices): harmful only if
      the view is then changed in place, which neither diffusers' model code nor the scripts do
      (the parity tests check losses and gradients against unwrapped models);
    - diffusers' ModelMixin.to(dtype) warns "modules ... should be kept in float32: []" even when
      there are none (UNet, VAE, FLUX transformer);
    - diffusers' from_pretrained recommends installing accelerate for low_cpu_mem_usage: this suite
      uses no accelerate by design (big models are built on meta and loaded shard by shard);
    - transformers says its CLIP/Siglip image processors fall back to PIL without torchvision: no
      image processor is used here;
    - the per-file "Loading weights" bars of transformers/diffusers from_pretrained, which write
      carriage returns into log files (the run's own bar and log lines stay);
    - torch's deprecation notice for funcol.all_gather_tensor, which diffusers' context-parallel
      output gather still calls (a FutureWarning about diffusers' code, nothing users can change);
    - with torchao installed (OPTIMIZER / BASE_DTYPE), what importing it prints on every rank on
      import of diffusers: its CUDA-only kernel libraries that do not load on CPU builds, torch's
      notice about torchao registering Enum constants with pytree, and diffusers' note that its
      torchao checkpoint classes moved (nothing here loads torchao-serialized checkpoints).
    Every other warning stays visible. Called before the scripts first import diffusers."""
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=r"`torch.distributed._functional_collectives.all_gather_tensor` is "
                            r"deprecated", category=FutureWarning)
    logging.getLogger("diffusers.models.modeling_utils").addFilter(
        lambda record: not any(s in record.getMessage() for s in ("should be kept in float32: []",
                                                                  "because `accelerate` was not found")))
    logging.getLogger("transformers.utils.import_utils").addFilter(
        lambda record: "requires torchvision (not installed)" not in record.getMessage())
    logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load "))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda record: "is an Enum subclass and is now natively supported" not in record.getMessage())
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(
        lambda record: "Unable to import `torchao` Tensor objects" not in record.getMessage())
    try:
        import diffusers.utils.logging
        import transformers.utils.logging
        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
