"""Reports of plans and runs: pictures (matplotlib), one self-contained HTML file, Chrome /
Perfetto traces of measured runs, and predicted vs measured stage times.

This package reads :class:`~torchplace.plan.Plan` s, problems and the executors' spans; it never
decides anything. matplotlib is imported only when a picture is drawn (``pip install
'torchplace[report]'``).
"""
from torchplace.report.figure import Picture
from torchplace.report.pictures import plot_graph, plot_memory, plot_schedule
from torchplace.report.timeline import Bar, predicted_timeline

__all__ = ["Bar", "Picture", "plot_graph", "plot_memory", "plot_schedule", "predicted_timeline"]
