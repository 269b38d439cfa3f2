"""`dflash-train doctor [--devices cpu|cuda|all] [--target T] [--quick] [...]`: staged checks of the
machine, each stage in its own child process under a time limit (diagnostics/doctor.py). This
process never touches a device or compiles (torch is imported with the config tree only)."""

from __future__ import annotations

from dflash_train.commands import Alias, Verdict
from dflash_train.diagnostics.doctor import STAGE_KINDS, DoctorOptions, run_doctor
from dflash_train.validate import validate_doctor as validate  # noqa: F401 - the command's check

HELP = "staged environment and compile diagnostics"
RECIPE = None
READS = ("doctor", "target.model")
ALIASES = (
    Alias("--devices", "doctor.devices"), Alias("--target", "target.model", also=("doctor.check_target=true",)),
    Alias("--json", "doctor.json_path"), Alias("--stage-timeout", "doctor.stage_timeout"),
    Alias("--quick", "doctor.quick", const="true"), Alias("--disk-dir", "doctor.disk_dir"),
    Alias("--stages", "doctor.stages"),
)


def run(cfg) -> Verdict:
    d = cfg.doctor
    opts = DoctorOptions(devices=d.devices, target=cfg.target.model if d.check_target else None,
                         json_path=d.json_path, stage_timeout=d.stage_timeout, quick=d.quick, disk_dir=d.disk_dir,
                         stages=d.stages or STAGE_KINDS)
    code = run_doctor(opts)  # prints every stage line and the verdict line (also written to --json)
    return Verdict("", "OK" if code == 0 else "FAILED", code, printed=True)
