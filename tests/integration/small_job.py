"""The small CPU TorchTitan job of the integration tests: its command-line arguments."""

from pathlib import Path


def job_args(job: Path, dump: Path, *extra: str, module: str = "pipetune_configs", config: str = "muse_glimmer_mm") -> list[str]:
    return ["--module", module, "--config", config, "--dump_folder", str(dump), "--hf_assets_path", str(job / "fixture" / "tokenizer"),
            "--dataloader.dataset_path", str(job / "data"), "--pipetune.latency_table", str(job / "table.json"),
            "--dataloader.gbs", "8", "--training.seq_len", "512", "--pipetune.calibration.online_window", "0", "--pipetune.budget_s", "60",
            "--pipetune.strict_order", "--debug.seed", "0", *extra]
