"""export: build deployable bundles (ExecuTorch / ONNX / eager artifacts + manifest).

``export_bundle`` is the library entry point and ``export.cli.main`` the command line
(``fedfleet export``). The heavy imports (torch, executorch, onnx) happen on first use, so
``fedfleet export --help`` stays fast.
"""

from __future__ import annotations

__all__ = ["ExportError", "ParityError", "export_bundle"]

# Bumped whenever the exporter writes different programs for the same inputs (e.g. revision 2:
# tail programs compute pointwise convolutions as matrix products; 3: the manifest records eager fp32
# outputs for --runtime auto). Caches of exported bundles
# (fedfleet.bundles) include it in their keys, so they never serve a bundle from older code.
EXPORTER_REVISION = 3


def __getattr__(name: str):
    if name in __all__:
        from export import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'export' has no attribute {name!r}")
