"""The composition root: ``create_app(settings)`` builds the one ASGI app that serves the data plane
(``rollway.gateway``), the control plane (``rollway.admin``) and the compatibility protocols (``rollway.agl``,
``rollway.osmosis``) over one store, with its lifespan, typed state, probes, request guards and replica report."""

from rollway.app.factory import create_app
from rollway.app.state import AppState

__all__ = ["AppState", "create_app"]
