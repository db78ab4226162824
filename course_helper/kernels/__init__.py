"""CUDA kernels: the course's sources (``*.cu`` here) and :class:`RawKernel`, a kernel of your
own launched on a course stream with the course's checks, timeline names and race tracking."""
from .raw import MODEL_SHAPE, RawKernel, source

__all__ = ["RawKernel", "source", "MODEL_SHAPE"]
