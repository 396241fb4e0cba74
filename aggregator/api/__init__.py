"""The aggregator's admin REST API, Prometheus metrics and web dashboard.

``app.create_app`` builds the FastAPI app; ``server`` runs it (and the rest of the operations
side) next to the service. Nothing here is imported by the service itself, so fastapi/uvicorn
load only when the API is used.
"""
