"""tools/gpu_check.py without a GPU: the rows sized to the disk with the scripts' own checkpoint
arithmetic, the deadline's arithmetic against one device call, the timed window (warm-up and compile
apart), the DMD2 step's bound from the plain rows, and the plumbing check on CPU with the rows that
need CUDA skipped.

    python -m pytest tests/test_gpu_check.py -q

The CPU checks launch `python tools/gpu_check.py --tiny --cpu` as users do, on the tiny default folders the
whole test run shares (FSDP_DIFFUSION_CACHE), the rows in fp32 as gpu_check runs them on CPU; the launches this
session's tests read run two side by side (`cli`: each trains one process at a time, which leaves a core idle).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from checkpoint import _gb
from tests.conftest import start, tiny_default
from tools import gpu

# the tests that read a launch of the CPU check -> its arguments (--tiny --cpu --skip_tests and an --out of its
# own added), longest first: two run side by side, each next one starting where one ends
CLI_RUNS = {
    "test_z_image_rows_on_cpu_train_resume_and_their_exports_sample_in_the_pipeline": ["--suite=z_image"],
    # the LoRA and DMD2 rows (the full fine-tune's resume and export: z_image's rows, tests/test_qwen_image.py)
    "test_qwen_rows_on_cpu_train_resume_export_and_load":
        ["--suite=qwen_image", "--runs=qwen_edit_64px_lora16_2refs,dmd_qwen_edit_32px_4step_lora64_ac"],
    "test_flux2_row_on_cpu_trains_resumes_and_its_export_samples_the_trained_sigmas":
        ["--suite=flux2", "--runs=dmd_flux2_klein_64px_4step_lora64_ac"],
    "test_wan_row_on_cpu_trains_resumes_and_its_export_samples_the_trained_sigmas":
        ["--suite=wan", "--runs=dmd_wan21_t2v_32p_9f_4step_lora64_ac"],
    "test_speed_rows_on_cpu_print_the_dmd_bound_and_the_channels_last_plain_row":
        ["--suite=speed", "--runs=dmd_sd15_32px_b32_ac_channels_last"],
    "test_plumbing_check_on_cpu_skips_the_cuda_rows_and_exits_0": ["--runs=cudnn_attention_probe"],
}
CLI_TIMEOUT = 900  # seconds one launch may take, the slowest (--suite=z_image: 4 trainings) under a loaded machine


@pytest.fixture(scope="module")
def cli(request, tmp_path_factory):
    """{test name: (exit code, output, --out folder)} of the CPU check's launches that this session's tests read
    (CLI_RUNS), two at a time."""
    wanted = {item.name for item in request.session.items}
    root = tmp_path_factory.mktemp("gpu_check_cli")

    def begin(name):
        return start(os.path.join("tools", "gpu_check.py"),
                     ["--tiny", "--cpu", "--skip_tests", *CLI_RUNS[name], f"--out={root / name}"], ranks=1)

    def one(name, proc=None):
        proc = proc or begin(name)
        try:
            text, _ = proc.communicate(timeout=CLI_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            text += f"\n(killed: still running after {CLI_TIMEOUT} s)"
        return proc.returncode, text, root / name

    names = [name for name in CLI_RUNS if name in wanted]
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        # the first started here: it starts the launch server (tests/zygote.py) the others then fork from too
        futures = [pool.submit(one, names[0], begin(names[0]))] + [pool.submit(one, name) for name in names[1:]]
        return {name: future.result() for name, future in zip(names, futures)}


def test_smaller_blocks_halve_to_one_of_each():
    sizes, size = [], (19, 38)
    while size:
        sizes.append(size)
        size = gpu.budget.smaller_blocks(size)
    assert sizes == [(19, 38), (9, 19), (4, 9), (2, 4), (1, 2), (1, 1)]


def test_smaller_blocks_halve_one_kind_to_one_and_leave_whole_and_tiny_models():
    sizes, size = [], (4,)
    while size:
        sizes.append(size)
        size = gpu.budget.smaller_blocks(size)
    assert sizes == [(4,), (2,), (1,)]  # Qwen-Image-Edit's dual-stream blocks
    assert gpu.budget.smaller_blocks(()) is None and gpu.budget.smaller_blocks("tiny") is None


def test_each_family_gives_the_check_its_facts():
    """Every family's GpuCheck: its block keys are its trained model's config keys, its default counts one per key,
    its tiny rows on spec.tiny's first folder, its label the table's; the check's core names no family."""
    import families
    checked = [spec for spec in families.SPECS if spec.gpu is not None]
    assert [s.name for s in families.SPECS if s.gpu is None] == []
    for spec in checked:
        g = spec.gpu
        sub = gpu.folders.trained_subfolder(spec.name)
        with open(os.path.join(gpu.folders.real_configs(spec.name), sub, "config.json")) as f:
            config = json.load(f)
        assert all(k in config for k in g.blocks) and len(g.default_blocks) == len(g.blocks), spec.name
        assert gpu.folders.default_size(spec.name, True) == "tiny" and spec.tiny, spec.name
        assert gpu.folders.model_label(spec.name, "tiny") == f"tiny {g.label}"
        assert all(sub_name in {c.subfolder for p in spec.pipelines for c in p.components} for sub_name, _ in g.parts)
    assert [gpu.folders.model_label(s.name, gpu.folders.default_size(s.name, False)) for s in checked] == [
        "SD-1.5", "FLUX 2+4 blocks", "Qwen-Image-Edit 4 blocks", "FLUX.2 klein 2+4 blocks", "Wan 2.1 T2V-1.3B 2 blocks",
        "Z-Image 2+1 blocks"]
    assert gpu.folders.model_label(None, None) == "-"
    core = ("folders", "budget", "reference", "run", "report", "cli")  # rows.py's rows name their family as data
    for module in core:
        source = open(os.path.join(os.path.dirname(gpu.__file__), f"{module}.py")).read()
        assert not [n for n in families.NAMES if f'"{n}"' in source], module


def test_a_renamed_suite_or_option_is_refused_in_one_line_naming_the_new_one(monkeypatch):
    from tools.gpu import cli
    for args, said in ((["--suite=qwen"], "--suite=qwen_image"), (["--qwen_blocks=2"], "--qwen_image_blocks"),
                       (["--suite=nope"],
                        "choose one of acceptance, speed, qwen_image, flux2, wan, z_image, fp8, fp8_qwen"),
                       (["--flux2_blocks=2"], "give 2 block count(s) (num_layers, num_single_layers)")):
        monkeypatch.setattr("sys.argv", ["gpu_check.py", *args])
        with pytest.raises(SystemExit) as stop:
            cli.main()
        assert said in str(stop.value) and "\n" not in str(stop.value), stop.value


def _rows(*specs):
    return [{"run": name, "size": size, "resume": False} for name, size in specs]


def test_fit_to_disk_shrinks_the_row_furthest_over_and_counts_each_new_folder_once():
    gb = gpu.budget.GB
    peak = {(2, 4): 30 * gb, (1, 2): 15 * gb, (1, 1): 8 * gb, "sd15": 20 * gb}  # a row's need by model size
    cost = {(2, 4): 0, (1, 2): 3 * gb, (1, 1): 2 * gb, "sd15": 0}  # (2, 4) written already

    def fit(rows, free, need=lambda r, z: peak[z] * (2 if r["run"] == "big" else 1)):
        return gpu.budget.fit_to_disk(rows, free, need, cost.get,
                                     lambda r, z: gpu.budget.smaller_blocks(z) if isinstance(z, tuple) else None)

    rows = _rows(("big", (2, 4)), ("small", (2, 4)), ("unet", "sd15"))
    free = 60 * gb + gpu.budget.HEADROOM
    assert fit(rows, free) == {"big": (2, 4), "small": (2, 4), "unet": "sd15"}  # 60 GB: each fits alone
    # 40 GB: "big" (60 GB) is over; at 1+2 it needs 30 GB, and its 3 GB folder leaves 37 GB for every row
    assert fit(rows, 40 * gb + gpu.budget.HEADROOM) == {"big": (1, 2), "small": (2, 4), "unet": "sd15"}
    # 24 GB: "big" goes to 1+1 (16 GB), "small" to 1+2 (15 GB); their folders (5 GB) leave 19 GB, and
    # SD-1.5 (20 GB) has no smaller model: not run
    assert fit(rows, 24 * gb + gpu.budget.HEADROOM) == {"big": (1, 1), "small": (1, 2), "unet": None}


@pytest.mark.slow  # ~15 s: the trained models of every row on meta, twice for the DMD2 row
def test_the_dmd_kontext_row_is_sized_down_to_fit_a_64_gb_disk(tmp_path):
    """A bare H100's 64 GB disk: with the 512 px Kontext-DMD2 row's checkpoint at 2+4 blocks (31.4 GB
    as the scripts' preflight counts it) and its export on disk, 23.4 GB are free, too little for the
    second checkpoint its resume writes. Sized before the rows (that row's output not yet written,
    nor the 2+4 transformer folder), the check gives that row 1+2 blocks and keeps every other row."""
    rows = gpu.rows.plan_runs(tiny=False)
    folders = {(): gpu.folders.real_configs("sd_unet")}  # configs only: all the arithmetic needs
    for r in rows:
        r["size"] = () if r["family"] == "sd_unet" else (2, 4)

    def folder(size):
        if size not in folders:
            folders[size] = gpu.folders.skeleton("flux", str(tmp_path), size, None)
        return folders[size]

    sizes = {}

    def row_bytes(r, size):
        if (r["run"], size) not in sizes:
            sizes[r["run"], size] = gpu.budget.row_bytes(r, folder(size))
        return sizes[r["run"], size]

    written = {}

    def folder_bytes(size):
        if size not in written:
            written[size] = gpu.budget.folder_bytes("flux", folder(size))
        return written[size]

    dmd = next(r for r in rows if r["run"] == "dmd_kontext_512px_4step_ac")
    one, export = row_bytes(dmd, (2, 4))
    assert _gb(one) == "31.4 GB"  # the preflight's figure on that machine
    free = int(23.4e9) + one + export + folder_bytes((2, 4))
    choice = gpu.budget.fit_to_disk(
        rows, free, lambda r, z: gpu.budget.peak_disk(*row_bytes(r, z), r["resume"]),
        lambda z: folder_bytes(z) if z else 0, lambda r, z: gpu.budget.smaller_blocks(z))
    assert choice == {r["run"]: (1, 2) if r is dmd else r["size"] for r in rows}


def test_the_qwen_rows_are_sized_by_the_scripts_arithmetic_and_halved_to_fit(tmp_path):
    """Qwen-Image-Edit at 4 blocks of real width (1.4 B parameters): the 512 px full fine-tune's
    checkpoint (fp32 weights and AdamW's two moments) is 16.8 GB and its resume needs two of them
    beside the 2.8 GB export; the 1024 px LoRA row's adapters are megabytes. With 40 GB to spare and
    no transformer written yet, the full row gets 2 blocks and the LoRA row keeps 4. The DMD2 row
    (LoRA r64 generator, full fake score: 16.9 GB at 4 blocks, resumed) gets 2 blocks too. Each row's bytes at
    each size and each folder's are computed once (fit_to_disk asks again on every round, as build() memoizes)."""
    rows = gpu.rows.plan_runs(tiny=False, suite="qwen_image")
    assert [r["run"] for r in rows] == ["qwen_edit_1024px_lora16_2refs", "qwen_edit_512px_full",
                                        "dmd_qwen_edit_512px_4step_lora64_ac"]
    lora, full, dmd = rows
    for r in rows:
        r["size"] = (4,)
    assert lora["settings"]["extra"]["reference_area"] == 1024 ** 2  # the pipeline's VAE_IMAGE_SIZE
    assert full["resume"] and full["settings"]["extra"]["condition_area"] == 384 ** 2  # its CONDITION_IMAGE_SIZE
    sizes, folders = {}, {}

    def row_bytes(r, blocks):
        if (r["run"], blocks) not in sizes:
            sizes[r["run"], blocks] = gpu.budget.row_bytes(r, gpu.folders.skeleton("qwen_image", str(tmp_path),
                                                                                    blocks, None))
        return sizes[r["run"], blocks]

    one, export = row_bytes(full, (4,))
    assert (_gb(one), _gb(export)) == ("16.8 GB", "2.8 GB")
    assert row_bytes(lora, (4,))[0] < 0.1 * gpu.budget.GB

    def need(r, blocks):
        return gpu.budget.peak_disk(*row_bytes(r, blocks), r["resume"])

    def folder_cost(blocks):
        if blocks not in folders:
            folders[blocks] = gpu.budget.folder_bytes("qwen_image",
                                                      gpu.folders.skeleton("qwen_image", str(tmp_path), blocks, None))
        return folders[blocks]

    choice = gpu.budget.fit_to_disk(rows, 40 * gpu.budget.GB + gpu.budget.HEADROOM, need, folder_cost,
                                   lambda r, z: gpu.budget.smaller_blocks(z))
    assert choice == {lora["run"]: (4,), full["run"]: (2,), dmd["run"]: (2,)}
    assert dmd["resume"] and dmd["settings"]["lora_rank"] == 64 and dmd["settings"]["extra"]["lora_alpha"] == 8
    assert _gb(row_bytes(dmd, (4,))[0]) == "16.9 GB"
    assert gpu.folders.model_label("qwen_image", (2,)) == "Qwen-Image-Edit 2 blocks"


def test_the_qwen_reference_reads_as_many_text_tokens_as_the_run():
    """The plain reference's prompt length is the length of what the pipeline's encode_prompt returns
    for the dataset's first prompt with its two references at the pipeline's 384^2 (what the run's
    text cache holds): 2 x 196 image tokens besides the template and the prompt."""
    import torch

    from families import qwen_image as qi
    from families.qwen_image.gpu import text_tokens
    model, data = tiny_default("qwen_image_edit")
    data = os.path.join(data, "data.jsonl")
    with open(data) as f:
        row = json.loads(f.readline())
    pipe = qi.load_text_encoder(str(model), torch.float32, torch.device("cpu"))
    area = 384 * 384
    images = qi.condition_images(pipe, [os.path.join(os.path.dirname(data), c) for c in qi.controls(row)], area)
    embeds, _ = pipe.encode_prompt(prompt=[row["prompt"]], image=images, device=torch.device("cpu"))
    assert text_tokens(str(model), data, area) == embeds.shape[1]


def test_deadline_starts_a_row_only_where_its_scaled_expectation_fits():
    deadline = gpu.budget.Deadline(100 + gpu.budget.END_RESERVE_S, time.monotonic())
    assert deadline.fits(90) and not deadline.fits(110)
    deadline.record(10, 20)  # the rows so far took twice their expected seconds
    assert deadline.scale() == 2 and not deadline.fits(60) and deadline.fits(40)
    deadline.record(100, 10)  # faster than expected: never trusted below half
    assert deadline.scale() == 0.5


def test_the_acceptance_rows_and_the_qwen_rows_each_fit_one_device_call():
    """The rows of each call (the acceptance suite; --suite=qwen_image): their expected seconds on an H100, the
    start-up and the plain references fit the deadline with the end's reserve kept, and the deadline
    plus that reserve fit the 9.5 minutes of one call."""
    rows = gpu.rows.plan_runs(tiny=False)
    for call in (rows, gpu.rows.plan_runs(tiny=False, suite="qwen_image")):
        refs = {(r["family"], r["settings"]["resolution"], r["settings"]["batch_size"]) for r in call if r["ref"]}
        expected = (gpu.rows.STARTUP_EXPECT_S + gpu.rows.REF_EXPECT_S * len(refs)
                    + sum(r["expect_s"] for r in call))
        assert expected <= gpu.budget.CALL_S - gpu.budget.END_RESERVE_S
    assert gpu.budget.CALL_S + gpu.budget.END_RESERVE_S <= 9.5 * 60
    assert [r["run"] for r in rows if r["gpu_only"]] == ["kontext_1024px_lora16_cudnn_attention_probe"]


def test_warm_up_steps_are_not_timed_and_compile_time_is_read_apart():
    records = [{"step": s, "step_ms": 100.0} for s in range(1, 13)]
    warm, timed = gpu.run.timed_window(records, 2, finished=True)
    assert [r["step"] for r in warm] == [1, 2] and [r["step"] for r in timed] == list(range(3, 13))
    assert gpu.run.timed_window(records[:2], 2, finished=False) == (records[:2], [])  # cut in its warm-up
    assert gpu.run.timed_window(records[:2], 2, finished=True) == ([], records[:2])  # a 2-step probe
    log = ("compile: 27 graphs, 0 graph breaks (181.5 s compiling)\nstep 00002/7 | 900 ms\n"
           "compile, whole run: 30 graphs, 0 graph breaks (190.25 s compiling)\n")
    assert gpu.run.compile_seconds(log) == 190.25
    assert gpu.run.compile_seconds("step 00002/7") != gpu.run.compile_seconds("step 00002/7")  # NaN


def test_compile_rows_time_one_cycle_after_their_warm_up_within_one_call():
    """A COMPILE=1 DMD2 row: 2 warm-up steps (a generator and a fake-score step: every graph compiled),
    then one whole cycle at ratio 5 (steps 3-7, the generator at step 6), and alone in a call (its
    plain reference and the start-up included) within the deadline."""
    rows = {r["run"]: r for r in gpu.rows.plan_runs(tiny=False, suite="speed")}
    row = rows["dmd_sd15_512px_b32_ac_compile"]
    assert row["warmup"] == 2 and row["steps"] == 7 and row["settings"]["extra"]["compile"] == 1
    assert gpu.report.dmd_network_ms({"fwd_ms": 1, "fwd_bwd_ms": 3}, list(range(3, 8)), 5, False)[1] == 1
    alone = gpu.rows.STARTUP_EXPECT_S + gpu.rows.REF_EXPECT_S + row["expect_s"]
    assert alone <= gpu.budget.CALL_S - gpu.budget.END_RESERVE_S
    assert rows["dmd_sd15_512px_b32_ac"]["steps"] == 12 and "fake_score_attention_dtype" not in \
        rows["dmd_sd15_512px_b32_ac"]["settings"]["extra"]  # the default row runs the defaults


def test_runs_are_picked_by_exact_name_or_by_part():
    rows = gpu.rows.plan_runs(tiny=False, suite="speed")
    assert [r["run"] for r in gpu.rows.select_runs(rows, "dmd_sd15_512px_b32_ac")] == ["dmd_sd15_512px_b32_ac"]
    picked = [r["run"] for r in gpu.rows.select_runs(rows, "b32_ac_compile,dmd_sd15_512px_b32_ac_fp32_fake")]
    assert picked == ["dmd_sd15_512px_b32_ac_fp32_fake", "dmd_sd15_512px_b32_ac_compile",
                      "dmd_sd15_512px_b32_ac_compile_channels_last"]
    assert gpu.rows.select_runs(rows, "") == rows


def test_dmd_bound_counts_the_network_calls_of_the_timed_steps():
    """F = 100 ms (forward, no grad), P = 300 ms (forward + backward). Steps 3-12 at ratio 5: the
    generator steps at 6 and 11 (iterations 5 and 10). Fake-score step F + P = 400 (1.33 P); generator
    step 2 P + 3 F = 900; mean (2 x 900 + 8 x 400) / 10 = 500. With AC, P + F = 400 for each
    forward + backward: (2 x 1100 + 8 x 500) / 10 = 620."""
    plain, steps = {"fwd_ms": 100.0, "fwd_bwd_ms": 300.0}, list(range(3, 13))
    assert gpu.report.dmd_network_ms(plain, steps, 5, ac=False) == (500.0, 2)
    assert gpu.report.dmd_network_ms(plain, steps, 5, ac=True) == (620.0, 2)
    ref = {"fwd_bwd_ms": 300.0, "fwd_ms": 100.0, "cl_fwd_bwd_ms": 250.0, "cl_mfu": 0.3, "model_tflop": 1.0,
           "mfu": 0.25, "adamw_ms": 5.0, "vae_ms": 7.0}
    row = {**gpu.run.blank_result({"run": "dmd_sd15_512px_b32_ac", "world": 1, "expect_s": 70}, "pass", True),
           "model": "SD-1.5", "step_ms": 682.0, "timed_steps": steps, "ref": "SD-1.5, 512 px, batch 32",
           "ratio": 5, "ac": True}
    report = gpu.report.table([row], {"SD-1.5, 512 px, batch 32": ref}, ["head"])
    assert "| SD-1.5, 512 px, batch 32, channels_last | 250.0 | - | 1.00 | 30.0 % | - | - |" in report
    assert "| dmd_sd15_512px_b32_ac | 2 + 8 | 620 | 682 | 1.10 | met |" in report
    slow = gpu.report.table([{**row, "step_ms": 800.0}], {"SD-1.5, 512 px, batch 32": ref}, ["head"])
    assert "| 620 | 800 | 1.29 | not met |" in slow
    # a flow teacher's backward simulation adds generator calls the bound does not count: no line
    qwen = {**row, "run": "dmd_qwen_edit_512px_4step_lora64_ac_profiled", "model": "Qwen-Image-Edit 4 blocks",
            "flow": True}
    assert "network calls" not in gpu.report.table([qwen], {"SD-1.5, 512 px, batch 32": ref}, ["head"])


def test_flux2_dmd_bound_counts_backward_simulation_the_cfg_pair_and_a_lora_generator():
    """F = 100, F2 (the teacher's true-CFG pair, one batch of 2) = 180, P = 300, P_G (a LoRA generator: frozen
    weights) = 200, V (the references' VAE encode) = 10. Steps 5, 6, 7 at ratio 5 with σ indices 0, 2, 3: step 6
    (iteration 5) is the generator's. Fake-score steps V + (k + 1) F + P: 410 (k 0), 710 (k 3); the generator step
    V + k F + P_G + F2 + F + P = 10 + 200 + 200 + 180 + 100 + 300 = 990; mean 2110 / 3. With AC each forward +
    backward adds F: + 100 on fake-score steps, + 200 on the generator's. A full generator: P in place of P_G."""
    plain = {"fwd_ms": 100.0, "fwd_pair_ms": 180.0, "fwd_bwd_ms": 300.0, "frozen_fwd_bwd_ms": 200.0, "vae_ms": 10.0}
    steps, indices = [5, 6, 7], [0, 2, 3]
    ms, gen = gpu.report.dmd_flow_network_ms(plain, steps, indices, 5, ac=False, lora_generator=True, cfg_pair=True)
    assert gen == 1 and ms == pytest.approx(2110 / 3)
    assert gpu.report.dmd_flow_network_ms(plain, steps, indices, 5, True, True, True)[0] == pytest.approx(2510 / 3)
    assert gpu.report.dmd_flow_network_ms(plain, steps, indices, 5, False, False, True)[0] == pytest.approx(2210 / 3)
    assert gpu.report.dmd_flow_network_ms(plain, steps, indices, 5, False, True, False)[0] == pytest.approx(2030 / 3)
    # DMD_LOSS=decoupled (Z-Image's default with its CFG pair): the conditional teacher at τ and at σ, + 2 F
    assert gpu.report.dmd_flow_network_ms(plain, steps, indices, 5, False, True, True,
                                          decoupled=True)[0] == pytest.approx(2310 / 3)
    ref = {**plain, "model_tflop": 1.0, "mfu": 0.3, "adamw_ms": 5.0}
    row = {**gpu.run.blank_result({"run": "dmd_flux2_klein_512px_4step_lora64_ac", "world": 1, "expect_s": 170},
                                    "pass", True),
           "model": "FLUX.2 klein 2+4 blocks", "step_ms": 770.0, "timed_steps": steps, "step_indices": indices,
           "ref": "klein", "ratio": 5, "ac": False, "lora_generator": True, "cfg_pair": True, "flow": True}
    assert "| dmd_flux2_klein_512px_4step_lora64_ac | 1 + 2 | 703 | 770 | 1.09 | met |" in \
        gpu.report.table([row], {"klein": ref}, ["head"])
    # without the logged σ indices the step's calls are unknown: no line
    assert "network calls" not in gpu.report.table([{**row, "step_indices": []}], {"klein": ref}, ["head"])


def test_the_flux2_rows_are_sized_by_the_scripts_arithmetic_and_fit_one_device_call(tmp_path):
    """klein-base-4B's transformer at 2 + 4 blocks of real width (1.2 B parameters): the LoRA r64 generator's
    adapters and the full fake score's fp32 weights and AdamW moments make a 14.3 GB checkpoint; the 512 px row
    resumes (two checkpoints beside the adapters' export), the 1024 px row only times. Both rows, the start-up and
    their two plain references fit one call."""
    rows = gpu.rows.plan_runs(tiny=False, suite="flux2")
    assert [r["run"] for r in rows] == ["dmd_flux2_klein_512px_4step_lora64_ac",
                                        "dmd_flux2_klein_1024px_4step_lora64_ac_timed"]
    assert all(r["ref"] and r["settings"]["lora_rank"] == 64 and r["settings"]["ac"] for r in rows)
    assert rows[0]["resume"] and not rows[1]["resume"]
    assert rows[0]["settings"]["extra"]["real_guidance_scale"] == 4.0
    folder = gpu.folders.skeleton("flux2", str(tmp_path), (2, 4), None)
    one, export = gpu.budget.row_bytes(rows[0], folder)
    assert (_gb(one), _gb(gpu.budget.peak_disk(one, export, True))) == ("14.3 GB", "28.7 GB")
    assert export < 0.1 * gpu.budget.GB  # the generator's adapters
    assert gpu.folders.model_label("flux2", (2, 4)) == "FLUX.2 klein 2+4 blocks"
    expected = gpu.rows.STARTUP_EXPECT_S + 2 * gpu.rows.REF_EXPECT_S + sum(r["expect_s"] for r in rows)
    assert expected <= gpu.budget.CALL_S - gpu.budget.END_RESERVE_S


def test_the_wan_rows_are_the_recipes_dmd2_sized_planned_and_fit_one_device_call(tmp_path, monkeypatch):
    """Wan 2.1 T2V-1.3B's transformer at 2 blocks of real width (0.12 B parameters):
    recipes/dmd_wan21_t2v_1.3b_lora.sh's DMD2 (LoRA r64 generator and fake score, CFG 5, AC) at 81 frames of 480 x
    832, whose latents the plain reference takes as the room lays them out (21 x 60 x 104; the tiny rows' 9 frames
    of 32 x 32: 3 x 4 x 4). Both trained models are adapters: a 0.141 GB checkpoint, 0.305 GB at the resume's peak.
    The planner is asked for the rows' FAKE_LORA and NUM_FRAMES; both rows, the start-up and their one plain
    reference fit one call."""
    from families.wan import gpu as wan_gpu
    rows = gpu.rows.plan_runs(tiny=False, suite="wan")
    assert [r["run"] for r in rows] == ["dmd_wan21_t2v_480p_81f_4step_lora64_ac",
                                        "dmd_wan21_t2v_480p_81f_4step_lora64_ac_timed"]
    assert rows[0]["resume"] and not rows[1]["resume"] and all(r["ref"] for r in rows)
    s = rows[0]["settings"]
    assert (s["resolution"], s["lora_rank"], s["ac"], s["export_dtype"]) == (480, 64, True, "bf16")
    assert {k: s["extra"][k] for k in ("num_frames", "fake_lora", "lora_alpha", "real_guidance_scale")} == {
        "num_frames": 81, "fake_lora": 1, "lora_alpha": 64, "real_guidance_scale": 5.0}
    folder = gpu.folders.skeleton("wan", str(tmp_path), (2,), gpu.folders.real_configs("wan"))
    assert wan_gpu.target_grid(folder, s) == (21, 60, 104)
    tiny = gpu.rows.plan_runs(tiny=True, suite="wan")[0]
    assert wan_gpu.target_grid(folder, tiny["settings"]) == (3, 4, 4)  # the tiny VAE's factors are the real ones
    one, export = gpu.budget.row_bytes(rows[0], folder)
    assert (_gb(one), _gb(gpu.budget.peak_disk(one, export, True))) == ("0.141 GB", "0.305 GB")
    assert export < 0.05 * gpu.budget.GB  # the generator's adapters
    from tools import memory_plan
    planned = []
    monkeypatch.setattr(memory_plan, "plan", lambda model, settings: planned.append(settings) or {"gpu_total": 1})
    gpu.budget.planned_bytes(folder, 1, s, "train_dmd.py", 80)
    gpu.budget.planned_bytes(folder, 1, gpu.rows.plan_runs(tiny=False, suite="flux2")[0]["settings"], "", 80)
    wan, flux2 = planned
    assert (wan.resolution, wan.frames, wan.lora_rank, wan.fake_lora, wan.activation_checkpointing) == (
        480, 81, 64, True, True)
    assert (flux2.frames, flux2.fake_lora) == (None, False)  # an image row: the family's frames (none)
    assert gpu.folders.model_label("wan", (2,)) == "Wan 2.1 T2V-1.3B 2 blocks"
    expected = gpu.rows.STARTUP_EXPECT_S + gpu.rows.REF_EXPECT_S + sum(r["expect_s"] for r in rows)
    assert expected <= gpu.budget.CALL_S - gpu.budget.END_RESERVE_S


@pytest.mark.slow  # 0.1 s in its file, 3.4 s alone (the first import of the transformer and the planner)
def test_the_z_image_rows_are_sized_planned_and_fit_one_device_call(tmp_path, monkeypatch):
    """Z-Image's transformer at 2 main + 1 refiner blocks of real width (0.73 B parameters): at 1024 x 1024 the
    text-to-image LoRA fine-tune (recipes/z_image_t2i_lora.sh: r64, AC) and DMD2 to a 4-step LoRA student
    (recipes/dmd_z_image_8step_lora.sh's LoRA r64 generator and fake score, CFG 5, on a bf16 base), both resumed:
    adapters only, 0.0946 and 0.189 GB checkpoints. Their data's prompts are long enough to be cut at
    MAX_SEQUENCE_LENGTH (the planner's 512 text tokens, the plain reference's); the planner is asked for each row's
    script, LORA_RANK, FAKE_LORA and AC; both rows, the start-up and their one plain reference fit one call."""
    from families.z_image import gpu as z_gpu
    from tools import memory_plan
    rows = gpu.rows.plan_runs(tiny=False, suite="z_image")
    assert [r["run"] for r in rows] == ["z_image_1024px_t2i_lora64_ac", "dmd_z_image_1024px_4step_lora64_ac"]
    assert [r["script"] for r in rows] == ["train_flux_kontext.py", "train_dmd.py"]
    assert all(r["resume"] and r["ref"] and r["settings"]["lora_rank"] == 64 and r["settings"]["ac"]
               and r["settings"]["resolution"] == 1024 for r in rows)
    tune, dmd = (r["settings"]["extra"] for r in rows)
    assert (tune["lora_alpha"], tune["lora_init"], dmd["fake_lora"], dmd["real_guidance_scale"]) == (64, "gaussian",
                                                                                                   1, 5.0)
    assert len({r["ref"] for r in rows}) == 1  # one plain reference: the same model, size and text
    folder = gpu.folders.skeleton("z_image", str(tmp_path), (2, 1), None)
    sizes = [gpu.budget.row_bytes(r, folder) for r in rows]
    assert [(_gb(one), _gb(gpu.budget.peak_disk(one, export, True))) for one, export in sizes] == [
        ("0.0946 GB", "0.221 GB"), ("0.189 GB", "0.41 GB")]
    assert gpu.folders.model_label("z_image", (2, 1)) == "Z-Image 2+1 blocks"
    planned = []
    monkeypatch.setattr(memory_plan, "plan", lambda model, settings: planned.append(settings) or {"gpu_total": 1})
    for r in rows:
        gpu.budget.planned_bytes(folder, 1, r["settings"], r["script"], 80)
    assert [(p.script, p.resolution, p.lora_rank, p.fake_lora, p.activation_checkpointing) for p in planned] == [
        ("train_flux_kontext.py", 1024, 64, False, True), ("train_dmd.py", 1024, 64, True, True)]
    prompts = gpu.folders.dataset(str(tmp_path), "z_image", 32, True, "train_dmd.py")
    t2i = gpu.folders.dataset(str(tmp_path), "z_image", 32, True, "train_flux_kontext.py")
    lines = open(prompts).read().splitlines()
    pairs = [json.loads(line) for line in open(t2i)]
    assert len(lines) == len(pairs) == 8 and os.path.exists(os.path.join(os.path.dirname(t2i), pairs[0]["image"]))
    assert min(len(p.split()) for p in lines + [r["prompt"] for r in pairs]) >= z_gpu.PROMPT_WORDS > 512
    assert z_gpu.reference_shape(folder, prompts, rows[1]["settings"]) == (512, ())
    expected = gpu.rows.STARTUP_EXPECT_S + gpu.rows.REF_EXPECT_S + sum(r["expect_s"] for r in rows)
    assert expected <= gpu.budget.CALL_S - gpu.budget.END_RESERVE_S


def test_a_lora_fake_scores_step_counts_its_frozen_weight_backward():
    """FAKE_LORA: the fake score's forward + backward is its frozen weights' (P_G), as a LoRA generator's. The
    FLUX.2 bound's figures (F 100, F2 180, P 300, P_G 200, V 10; steps 5, 6, 7 at σ indices 0, 2, 3) with a LoRA
    fake score: fake-score steps V + (k + 1) F + P_G = 310, 610; the generator step V + k F + P_G + F2 + F + P_G =
    890; a step that encodes nothing (text to video, V = 0): 30 less each."""
    plain = {"fwd_ms": 100.0, "fwd_pair_ms": 180.0, "fwd_bwd_ms": 300.0, "frozen_fwd_bwd_ms": 200.0, "vae_ms": 10.0}
    steps, indices = [5, 6, 7], [0, 2, 3]
    ms, gen = gpu.report.dmd_flow_network_ms(plain, steps, indices, 5, False, True, True, lora_fake=True)
    assert gen == 1 and ms == pytest.approx(1810 / 3)
    none = gpu.report.dmd_flow_network_ms({**plain, "vae_ms": 0.0}, steps, indices, 5, False, True, True, True)
    assert none[0] == pytest.approx(1780 / 3)


def test_the_fp8_rows_pair_each_recipe_with_bf16_and_fit_one_call_each():
    """--suite=fp8 (Kontext 1024 px full fine-tune, cached latents) and --suite=fp8_qwen (Qwen-Image-Edit 1024 px
    LoRA, two references): bf16, tensorwise and rowwise, eager and compiled, 12 steps each from the same seed; each
    call's rows, start-up and plain reference fit the deadline."""
    for suite, base in (("fp8", "kontext_1024px_full_cached"), ("fp8_qwen", "qwen_edit_1024px_lora16_2refs")):
        rows = gpu.rows.plan_runs(tiny=False, suite=suite)
        names = [base + c + r for c in ("", "_compile") for r in ("", "_fp8_tensorwise", "_fp8_rowwise")]
        assert [r["run"] for r in rows] == names
        assert all(r["steps"] == gpu.rows.FP8_STEPS and r["settings"]["resolution"] == 1024 for r in rows)
        assert [r["settings"]["extra"].get("fp8", "") for r in rows] == ["", "tensorwise", "rowwise"] * 2
        expected = gpu.rows.STARTUP_EXPECT_S + gpu.rows.REF_EXPECT_S + sum(r["expect_s"] for r in rows)
        assert expected <= gpu.budget.CALL_S - gpu.budget.END_RESERVE_S, suite


def test_fp8_lines_set_each_recipe_beside_bf16():
    """Speed-up = bf16 step / FP8 step against FP8_GOAL (Kontext rows), a compiled row's MFU from its eager twin
    (eager MFU 40 % at 200 ms: the same FLOPs at 100 ms are 80 %), the largest relative loss difference and the
    losses side by side."""
    def result(name, ms, mfu, losses):
        return {**gpu.run.blank_result({"run": name, "world": 1, "expect_s": 50}, "pass", True),
                "step_ms": ms, "mfu": mfu, "losses": losses}
    base = "kontext_1024px_full_cached"
    rows = [result(base, 300.0, 0.30, [1.0, 2.0]), result(base + "_fp8_tensorwise", 200.0, 0.40, [1.01, 2.0]),
            result(base + "_compile", 250.0, float("nan"), [1.0, 2.0]),
            result(base + "_compile_fp8_tensorwise", 100.0, float("nan"), [1.0, 1.9])]
    text = "\n".join(gpu.report.fp8_lines(rows))
    assert f"| {base}_fp8_tensorwise | 200 | 300 | 1.50 | met | 40.0 % | 30.0 % | 1.00e-02 (2 steps) |" in text
    assert f"| {base}_compile_fp8_tensorwise | 100 | 250 | 2.50 | met | 80.0 % | 36.0 % | 5.00e-02 (2 steps) |" in text
    assert "| 2 | 2.00000 | 1.90000 |" in text
    assert gpu.report.fp8_lines(rows[:1]) == []


@pytest.mark.slow
def test_flux2_row_on_cpu_trains_resumes_and_its_export_samples_the_trained_sigmas(cli, request):
    """The tiny klein-base DMD2 row (--suite=flux2): trained with its plain reference (the teacher's pair and the
    frozen-weight backward among its calls), saved, resumed, exported, the LoRA export sampled by Flux2KleinPipeline
    in 4 steps at the trained σ list, and set against its network calls."""
    rc, stdout, out = cli[request.node.name]
    assert rc == 0, stdout[-6000:]
    assert "export sampled in 4 steps: σ seen [1.0, 0.75, 0.5, 0.25]" in stdout
    result = json.loads((out / "gpu_check.json").read_text())
    row, = result["rows"]
    assert row["ok"] and row["resume_export"] == "pass" and row["model"] == "tiny FLUX.2 klein"
    assert len(row["step_indices"]) == len(row["timed_steps"]) == 10
    ref, = result["refs"].values()
    assert all(ref[k] > 0 for k in ("fwd_ms", "fwd_pair_ms", "fwd_bwd_ms", "frozen_fwd_bwd_ms", "vae_ms"))
    assert "| dmd_flux2_klein_64px_4step_lora64_ac | 2 + 8 |" in (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_wan_row_on_cpu_trains_resumes_and_its_export_samples_the_trained_sigmas(cli, request):
    """The tiny Wan DMD2 row (--suite=wan, 9 frames of 32 x 32): trained with its plain reference (the teacher's CFG
    pair and the frozen-weight backward among its calls; no VAE encode: text to video), saved, resumed, exported,
    the LoRA export sampled by WanPipeline in 4 steps at the trained σ list (flow_shift 3), and set against its
    network calls."""
    rc, stdout, out = cli[request.node.name]
    assert rc == 0, stdout[-6000:]
    assert ("export sampled in 4 steps: (1, 9, 32, 32, 3) video, timesteps seen [1000.0, 928.205, 799.283, 500.0]"
            in stdout)
    result = json.loads((out / "gpu_check.json").read_text())
    row, = result["rows"]
    assert row["ok"] and row["resume_export"] == "pass" and row["model"] == "tiny Wan 2.1 T2V-1.3B"
    assert len(row["step_indices"]) == len(row["timed_steps"]) == 10 and row["lora_fake"] and row["cfg_pair"]
    ref, = result["refs"].values()
    assert all(ref[k] > 0 for k in ("fwd_ms", "fwd_pair_ms", "fwd_bwd_ms", "frozen_fwd_bwd_ms"))
    assert ref["vae_ms"] == 0
    assert "| dmd_wan21_t2v_32p_9f_4step_lora64_ac | 2 + 8 |" in (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_z_image_rows_on_cpu_train_resume_and_their_exports_sample_in_the_pipeline(cli, request):
    """The tiny Z-Image rows (--suite=z_image, 32 px, 32 text tokens): the text-to-image LoRA fine-tune and DMD2 to a
    4-step LoRA student, each trained beside their one plain reference (the teacher's CFG pair and the frozen-weight
    backward among its calls, the model's list inputs and outputs; nothing encoded), saved, resumed, exported, and the
    export sampled by ZImagePipeline with load_lora_weights: the fine-tune's with CFG on the base's scheduler, the
    DMD2 student's without CFG at the trained σ list (the transformer gets 1 - σ); DMD2 set against its network
    calls."""
    rc, stdout, out = cli[request.node.name]
    assert rc == 0, stdout[-6000:]
    assert "export sampled in 4 steps at CFG 4.0: (1, 32, 32, 3) image" in stdout
    assert ("export sampled in 4 steps without CFG: (1, 32, 32, 3) image, timesteps seen [0.0, 0.25, 0.5, 0.75], "
            "trained [0.0, 0.25, 0.5, 0.75], adapters True, finite True") in stdout
    result = json.loads((out / "gpu_check.json").read_text())
    rows = {row["run"]: row for row in result["rows"]}
    assert list(rows) == ["z_image_32px_t2i_lora64_ac", "dmd_z_image_32px_4step_lora64_ac"]
    assert all(row["ok"] and row["resume_export"] == "pass" and row["model"] == "tiny Z-Image" and row["step_ms"] > 0
               for row in rows.values())
    dmd = rows["dmd_z_image_32px_4step_lora64_ac"]
    assert len(dmd["step_indices"]) == len(dmd["timed_steps"]) == 10 and dmd["lora_fake"] and dmd["cfg_pair"]
    ref, = result["refs"].values()
    assert all(ref[k] > 0 for k in ("fwd_ms", "fwd_pair_ms", "fwd_bwd_ms", "frozen_fwd_bwd_ms"))
    assert ref["vae_ms"] == 0
    report = (out / "gpu_check.md").read_text()
    assert "| tiny Z-Image, 32 px, batch 1, text to image |" in report
    assert "| dmd_z_image_32px_4step_lora64_ac | 2 + 8 |" in report
    assert "attention: ZImageTransformer2DModel native (diffusers' dispatcher)" in (out / "runs.log").read_text()


@pytest.mark.slow
def test_plumbing_check_on_cpu_skips_the_cuda_rows_and_exits_0(cli, request):
    rc, stdout, out = cli[request.node.name]
    assert rc == 0, stdout[-6000:]
    report = (out / "gpu_check.md").read_text()
    assert report.startswith("GPU check on CPU: torch ")
    assert f"disk: {out}" in report and "GB free of" in report
    row = next(line for line in report.splitlines() if "cudnn_attention_probe" in line)
    assert "skipped: needs CUDA" in row and "tiny FLUX" in row
    result = json.loads((out / "gpu_check.json").read_text())["rows"][0]
    assert result["ok"] and result["disk_need_gb"] > 0


@pytest.mark.slow
def test_speed_rows_on_cpu_print_the_dmd_bound_and_the_channels_last_plain_row(cli, request):
    """The speed suite's CHANNELS_LAST DMD2 row on the tiny SD-1.5 on CPU: the plain reference with
    its channels_last row, the run's warm-up apart, and the DMD2 bound from the plain rows."""
    rc, stdout, out = cli[request.node.name]
    assert rc == 0, stdout[-6000:]
    report = (out / "gpu_check.md").read_text()
    assert "| tiny SD-1.5, 32 px, batch 2, channels_last |" in report
    row = json.loads((out / "gpu_check.json").read_text())["rows"][0]
    assert row["ok"] and row["timed_steps"] == list(range(3, 13)) and row["warmup_s"] > 0
    assert "| dmd_sd15_32px_b32_ac_channels_last | 2 + 8 |" in report


@pytest.mark.slow
def test_qwen_rows_on_cpu_train_resume_export_and_load(cli, request):
    """The tiny Qwen-Image-Edit rows of --suite=qwen_image that the family's own tests do not run as the check does:
    LoRA with two references beside its plain reference; DMD2 with the Lightning settings saved, resumed and
    exported."""
    rc, stdout, out = cli[request.node.name]
    assert rc == 0, stdout[-6000:]
    result = json.loads((out / "gpu_check.json").read_text())
    qwen = {row["run"]: row for row in result["rows"]}
    assert list(qwen) == ["qwen_edit_64px_lora16_2refs", "dmd_qwen_edit_32px_4step_lora64_ac"]
    assert all(row["ok"] and row["status"] == "pass" and row["model"] == "tiny Qwen-Image-Edit"
               and row["step_ms"] > 0 for row in qwen.values())
    assert qwen["dmd_qwen_edit_32px_4step_lora64_ac"]["resume_export"] == "pass"
    refs = result["refs"]
    # a plain reference beside each fine-tuning row (the DMD2 row has none, as in the acceptance suite)
    assert qwen["dmd_qwen_edit_32px_4step_lora64_ac"]["ref"] == ""
    assert {row["ref"] for row in qwen.values() if row["ref"]} == set(refs)
    assert all(ref["fwd_bwd_ms"] > 0 for ref in refs.values())
