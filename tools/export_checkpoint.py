"""Export any checkpoint step as the run's end exports it: a LoRA run's pytorch_lora_weights.safetensors
(with LORA_EXPORT_MERGED the merged pipeline too), a full run's pipeline folder, the EMA where the run
kept one, a distilled generator's scheduler beside it.

    python tools/export_checkpoint.py out/qwen_edit_lora/checkpoints/step_001500
    python tools/export_checkpoint.py CHECKPOINT --output_dir=out/step1500 --nproc_per_node=8 --lora_export_merged=1

The checkpoint's own config.json names every setting of the run; the script that wrote it
(train_dmd.py or train_flux_kontext.py) runs again under torchrun with those settings, resumes the
checkpoint (DCP reshards it to any number of ranks) with MAX_STEPS at its step, so it trains nothing, and
writes OUTPUT_DIR/export exactly as at the end of a run. OUTPUT_DIR defaults to
<run>/exports/step_NNNNNN; the run's text cache is read where the run kept it. Other --name=value
arguments override settings (e.g. --export_dtype=bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.readme_constants import settings  # noqa: E402

SCRIPTS = ("train_dmd.py", "train_flux_kontext.py")


def script_of(config: dict) -> str:
    """The script whose settings are exactly the checkpoint's (one of SCRIPTS)."""
    names = set(config)
    for script in SCRIPTS:
        if {name for name, _, _ in settings(os.path.join(ROOT, script))} <= names:
            return script
    raise SystemExit("error: the checkpoint's config.json names the settings of neither train_dmd.py nor "
                     "train_flux_kontext.py")


def export_command(checkpoint: str, output_dir: str, nproc: int, extra: list[str]) -> list[str]:
    """torchrun ... SCRIPT --<every setting of the checkpoint> --resume=CHECKPOINT --max_steps=STEP ..."""
    checkpoint = os.path.abspath(checkpoint.rstrip("/"))
    for name in ("config.json", "trainer_state.json"):
        if not os.path.isfile(os.path.join(checkpoint, name)):
            raise SystemExit(f"error: {checkpoint}: no {name}, not a checkpoint folder of train_dmd.py or "
                             "train_flux_kontext.py")
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        step = json.load(f)["step"]
    script = script_of(config)
    own = {name for name, _, _ in settings(os.path.join(ROOT, script))}
    run_dir = os.path.dirname(os.path.dirname(checkpoint))
    out = os.path.abspath(output_dir or os.path.join(run_dir, "exports", f"step_{step:06d}"))
    values = {k: v for k, v in config.items() if k in own}
    values.update(RESUME=checkpoint, MAX_STEPS=step, OUTPUT_DIR=out, SAMPLE_EVERY=0,
                  TEXT_CACHE_DIR=config.get("TEXT_CACHE_DIR") or os.path.join(config["OUTPUT_DIR"], "text_cache"))
    args = [f"--{k.lower()}={json.dumps(v) if isinstance(v, list) else v}" for k, v in values.items()]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(ROOT, script), *args, *extra]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, OUTPUT_DIR/checkpoints/step_NNNNNN")
    p.add_argument("--output_dir", default="", help="where export/ is written (default: <run>/exports/step_N)")
    p.add_argument("--nproc_per_node", type=int, default=1, help="ranks (a model that does not fit one GPU: more)")
    args, extra = p.parse_known_args(argv)
    return subprocess.call(export_command(args.checkpoint, args.output_dir, args.nproc_per_node, extra))


if __name__ == "__main__":
    sys.exit(main())
