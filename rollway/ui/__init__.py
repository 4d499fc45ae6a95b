"""The web dashboard (``/ui``): static pages that read and act through the admin API only.

``routes.build_router()`` serves one HTML shell for every page path and the files in ``static/`` (ES modules,
a style sheet); the browser does the rest with ``fetch`` calls to ``/admin/v1``. The room imports nothing
first-party: it holds no data and no token. See ``docs/dashboard.md``.
"""
