"""What each magic does once its line is parsed: one small module per magic's actions.

cluster (%cluster), run (%%distributed, %%rank, compare), metrics (%dist_compare,
%dist_metrics), commbench, plan (%dist_plan), checkpoint (%dist_checkpoint),
transfer (%dist_push, %dist_pull); common holds the checks they share and
state the Session the magics own. These wire the cluster and execution layers
to the notebook's display.
"""
from . import checkpoint, cluster, commbench, metrics, plan, run, state, transfer

__all__ = ["checkpoint", "cluster", "commbench", "metrics", "plan", "run", "state", "transfer"]
