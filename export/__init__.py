"""export: build deployable bundles (ExecuTorch / ONNX / eager artifacts + manifest).

``export_bundle`` is the library entry point and ``export.cli.main`` the command line
(``fedfleet export``). The heavy imports (torch, executorch, onnx) happen on first use, so
``fedfleet export --help`` stays fast.
"""

from __future__ import annotations

__all__ = ["ExportError", "ParityError", "export_bundle"]


def __getattr__(name: str):
    if name in __all__:
        from export import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'export' has no attribute {name!r}")
