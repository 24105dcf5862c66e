"""The benchmarks (tools/benchmarks.py runs cli.main; cli's docstring lists them), by experiment: common (the
2-rank launches and what they share), scripts (save, step, planner, compile), stack (FSDP1 vs FSDP2 vs DDP), dmd
(noise, gan_head, fake_fp32), width (nf4_width, kontext_dmd_width), host (host, reshard), cli (main)."""
