"""Notebook UI for nbtool (installed as ``nbtool.widgets``).

Kernel-side only: engines never import this package. Views here take plain
records (dicts, dataclasses) and render them; they never reach into engines.
"""
from .cluster_view import ProgressLine, StatusTable
from .compare import Comparison
from .dashboard import Dashboard
from .figures import figure_bundle, show_figure

__all__ = ["Comparison", "Dashboard", "ProgressLine", "StatusTable", "figure_bundle", "show_figure"]
