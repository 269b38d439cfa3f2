"""`dflash-train train [--recipe NAME] [--resume] [section.field=value ...]`.

Run directly (one process) or under torchrun (one process per GPU, any number of nodes). With no
arguments it runs the embedded default recipe end to end on CPU (or a GPU when there is one).
Every rank validates the config and the topology before the target is loaded; a rank that fails
later prints its error and exits at once, so torchrun stops the job.
"""

from __future__ import annotations

import os

from dflash_train.commands import Alias, Verdict
from dflash_train.config import ConfigError
from dflash_train.validate import check_topology, validate_run, world_size_from_env

HELP = "train a drafter (default: the embedded SmolLM2 recipe, on CPU)"
RECIPE = "default"
READS = ("target", "drafter", "data", "loss", "optim", "train", "topology", "eval")
ALIASES = (Alias("--resume", "train.resume", const="true"),)


def validate(cfg) -> None:
    problems = check_topology(cfg, world_size_from_env())
    if problems:  # a Topology cannot even be built from these settings
        raise ConfigError(problems[0])
    from dflash_train.train.parallel.topology import topology_from_env  # imports torch (commands/__init__.py)

    topology = cfg.topology
    validate_run(cfg, topology_from_env(topology.mode, topology.target_ranks, topology.target_group_size,
                                        topology.target_parallel))


def run(cfg) -> str | Verdict:
    from dflash_train.train.state import run_lock
    from dflash_train.train.command import summary
    from dflash_train.train.loop import train
    from dflash_train.train.parallel.topology import topology_from_env

    topology = cfg.topology
    topo = topology_from_env(topology.mode, topology.target_ranks, topology.target_group_size, topology.target_parallel)
    with run_lock.held(cfg.train.out_dir, enabled=topo.is_main):  # the rank that writes the run directory
        result = train(cfg)
    if result.get("role") == "drafter" and "export" in result:
        print(summary(result), flush=True)
    rank = os.environ.get("RANK", "0")
    stopped = result.get("interrupted")
    if not stopped:
        done = f"(rank {rank}, {result.get('role')}, {result.get('steps', '-')} steps)"
        warnings = result.get("warnings")
        return Verdict(f"{'; '.join(warnings)} {done}", "WARNING") if warnings else done
    if not result.get("main"):  # one verdict for the job: the main drafter rank's
        print(f"[rank {rank}] {result.get('role')}: stopped with the job after step {stopped['step']} "
              f"({stopped['cause']}); the main drafter rank reports it", flush=True)
        return Verdict("", "INTERRUPTED", 3, printed=True)
    return Verdict(f"after step {stopped['step']} of {result['total_steps']} ({stopped['cause']}): checkpoint "
                   f"{result.get('checkpoint')}; continue with the same command and --resume", "INTERRUPTED", 3)
