"""The multi-node notebook needs a Slurm (sbatch on PATH with a reachable controller): it is
collected only where SLURM_CONF names one; tests/test_slurm.py runs it under nbval on the
Slurm it starts."""
import os

collect_ignore = [] if os.environ.get("SLURM_CONF") else ["09_multi_node.ipynb"]
