"""The TensorBoard sink: event files under ``<run>/tensorboard`` written with tensorboard's own event writer and
protos (no TensorFlow, no torch): scalars, histograms, and the run config as a text summary."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from relax_services.config import MetricsConfig
from relax_services.reporting.sinks import Digest, Histogram

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Writes each digest's scalars (``simple_value``) and histograms (``HistogramProto``) at its step."""

    def __init__(self, run_dir: Path, config: Mapping[str, object], config_text: str, settings: MetricsConfig) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(run_dir / "tensorboard"))
        # The config as the text plugin reads it: a rank-1 string tensor holding the YAML (dtype 7 is DT_STRING).
        text = TensorProto(
            dtype=7,
            string_val=[config_text.encode("utf-8")],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        value = Summary.Value(tag="config", metadata=meta, tensor=text)
        self._writer.add_event(Event(wall_time=time.time(), step=0, summary=Summary(value=[value])))

    def write(self, item: Digest) -> None:
        """Add one event holding the digest's scalars and histograms."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in item.scalars.items()]
        values += [Summary.Value(tag=tag, histo=_histo(h)) for tag, h in item.histograms.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=item.step, summary=Summary(value=values)))

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def _histo(h: Histogram) -> object:
    """TensorBoard's histogram proto: ``bucket[i]`` counts the values up to ``bucket_limit[i]`` (right edges)."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    return HistogramProto(
        min=min(h.values),
        max=max(h.values),
        num=len(h.values),
        sum=sum(h.values),
        sum_squares=sum(v * v for v in h.values),
        bucket_limit=h.edges[1:],
        bucket=h.counts,
    )
