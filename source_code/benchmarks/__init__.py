"""ScaleLab's benchmarks: each module measures one figure of the report; ``benchmarks.run`` runs them
all and writes ``report.json``, ``report.md`` and PNG plots.

    PYTHONPATH=source_code .venv/bin/python -m benchmarks.run --out bench-report [--quick]

The scripts that must run under ``horovodrun`` or in a TensorFlow process of their own
(``allreduce_bandwidth.py``, ``train_step_throughput.py``, ``class_grading.py``) import only ``scalelab``, so the
runner starts them by path; the runner itself never imports TensorFlow, so every measurement has a fresh process
with its own thread settings.
"""
