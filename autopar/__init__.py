"""autopar: give it an unmodified single-device model and a device mesh; get back the same model
running as a distributed program, with every collective explicit in its graph."""

from autopar.api import ParallelModule, parallelize
from autopar.capture import CaptureError
from autopar.plan import CommRow, Plan, Strategy

__all__ = ["parallelize", "ParallelModule", "Plan", "Strategy", "CommRow", "CaptureError"]
