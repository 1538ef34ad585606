"""autopar: give it an unmodified single-device model and a device mesh; get back the same model
running as a distributed program, with every collective explicit in its graph."""

from autopar.agree import RankMismatchError
from autopar.api import ParallelModule, parallelize, plan
from autopar.capture import CaptureError
from autopar.plan import CommRow, Estimate, Plan, Strategy
from autopar.profile import profile
from autopar.solver import InfeasibleError
from autopar.tune import TuneResult, tune
from autopar.verify import VerifyReport, verify
from autopar.weights import load


__all__ = ["parallelize", "plan", "load", "verify", "profile", "tune", "TuneResult", "ParallelModule", "Plan", "Strategy", "CommRow",
           "Estimate", "VerifyReport", "CaptureError", "InfeasibleError", "RankMismatchError"]
