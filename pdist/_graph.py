"""``graph_capture``: run a block on a side stream, as CUDA-graph capture wants."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from ._group import DistContext, Group, as_group

__all__ = ["GraphCaptureContext", "graph_capture"]


@attrs.frozen
class GraphCaptureContext:
    """What ``graph_capture`` yields: the stream the block runs on (None on CPU)."""

    stream: Any


@contextlib.contextmanager
def graph_capture(group: Group | DistContext, stream: Any = None) -> Iterator[GraphCaptureContext]:
    """Run the block on a side stream that first waits for the current stream.

    On CUDA, ``stream`` (default: a new one on the group's device) is the current
    stream in the block; on CPU the block runs as is and the ``stream`` is None.

    Example:
        ```python
        with pdist.graph_capture(ctx.tp) as capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=capture.stream):
                out = model(static_input)
        ```
    """
    g = as_group(group)
    if g.device.type != "cuda":
        yield GraphCaptureContext(stream=None)
        return
    side = stream if stream is not None else torch.cuda.Stream(device=g.device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(g.device))
    with torch.cuda.stream(side):
        yield GraphCaptureContext(stream=side)
