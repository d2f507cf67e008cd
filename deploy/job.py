"""Ray Jobs entry point: ``fedrod-ray train`` as the job's driver, joined to the cluster it was submitted to.

    ray job submit --working-dir . --runtime-env deploy/runtime_env.yaml -- \
        python deploy/job.py --config configs/quickstart.yaml [--set key=value ...] [--run-dir DIR]

Takes ``fedrod-ray train`` arguments and adds ``--address auto`` unless an address is given (the job
supervisor points ``RAY_ADDRESS`` at its own cluster, so ``auto`` joins exactly that one).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run the uploaded working_dir's code, not whichever fedrod_ray happens to be installed in the image.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedrod_ray.cli import main


def job_argv(argv: list[str]) -> list[str]:
    if not any(a == "--address" or a.startswith("--address=") for a in argv):
        argv = [*argv, "--address", "auto"]
    return ["train", *argv]


if __name__ == "__main__":
    sys.exit(main(job_argv(sys.argv[1:])))
