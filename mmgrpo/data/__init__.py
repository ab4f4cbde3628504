"""Task rows and the media they refer to: ``records`` reads and checks rows (JSONL, JSON, parquet, datasets
folders, hub ids), ``media`` opens the images and videos they name. Nothing here knows about models."""

from mmgrpo.data.media import (
    describe_ref,
    is_video_ref,
    load_video,
    model_image_size,
    open_image,
    to_rgb,
    video_reader,
)
from mmgrpo.data.records import Record, check_records, read_records

__all__ = [
    "Record",
    "check_records",
    "describe_ref",
    "is_video_ref",
    "load_video",
    "model_image_size",
    "open_image",
    "read_records",
    "to_rgb",
    "video_reader",
]
