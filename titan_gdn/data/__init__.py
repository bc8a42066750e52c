"""Packed-document data loading: sources, packing, and the TrainSpec loader builders."""

from titan_gdn.data.loader import build_packed_dataloader, build_packed_validation_dataloader
from titan_gdn.data.packing import PackedDocumentDataset, documents_per_row
from titan_gdn.data.sources import (
    SUPPORTED_DATASETS,
    TINYSHAKESPEARE_PATH,
    build_document_source,
)

__all__ = [
    "SUPPORTED_DATASETS",
    "TINYSHAKESPEARE_PATH",
    "PackedDocumentDataset",
    "build_document_source",
    "build_packed_dataloader",
    "build_packed_validation_dataloader",
    "documents_per_row",
]
