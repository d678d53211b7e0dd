"""A model-agnostic static-shape graph runner: bucket sets and bucket choice, warm-up, capture
into one shared pool, replay, and the eager fallback."""

from .buckets import Bucket, BucketSet, largest_first
from .runner import CaptureReport, GraphRunner

__all__ = ["Bucket", "BucketSet", "CaptureReport", "GraphRunner", "largest_first"]
