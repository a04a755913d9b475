"""Converting models for other runtimes: `qiao export onnx` (BERT-family sentence encoders)."""

from qiao.export.onnx import ExportError, ExportReport, export_onnx

__all__ = ["ExportError", "ExportReport", "export_onnx"]
