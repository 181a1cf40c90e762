"""The grader as a shared service: ``hub.py`` is the Assess service for a class, a JupyterHub managed service.

The single-user Assess service of ``make lab`` stays a Jupyter server extension (``grader/serve.py``); both are
thin adapters over the same ``AssessService`` (queue, workers, what a student may see).
"""
